"""The learner as the coordinator calls it: one service with one address (the actor, and the
critic and reference of PPO, each a learner of its own). Every call has the deadline, and every
error names the learner and the call (``ServiceRpcError``)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from relayrl.common import logcontext
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.clients.rotation import OPTIONS
from relayrl.coordinator.errors import ServiceRpcError
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

logger = logging.getLogger(__name__)


class LearnerClient:
    """A learner's rank 0 as the coordinator calls it (the actor, or PPO's critic or reference:
    ``name``): one channel, the deadline on every call, and every error naming the learner and
    the call (``ServiceRpcError``)."""

    def __init__(
        self, address: str, deadline: float, security: ClientSecurity | None = None, name: str = "learner"
    ):
        self.channel = client_channel(address, security, OPTIONS)
        self.stub = lg.LearnerServiceStub(self.channel)
        self.deadline = deadline
        self.name = f"{name} ({address})"
        self._forgetting: set[asyncio.Future] = set()  # UnregisterGenerator calls under way

    async def _call(self, rpc: str, request):
        try:
            return await getattr(self.stub, rpc)(
                request, timeout=self.deadline, metadata=logcontext.current()
            )
        except grpc.aio.AioRpcError as e:
            raise ServiceRpcError(e, self.name, rpc) from None

    async def register_generator(self, replica_id: str, address: str) -> lp.RegisterGeneratorResponse:
        await self._forgotten()
        req = lp.RegisterGeneratorRequest(address=address, replica_id=replica_id)
        return await self._call("RegisterGenerator", req)

    async def unregister_generator(self, replica_id: str) -> None:
        await self._call("UnregisterGenerator", lp.UnregisterGeneratorRequest(replica_id=replica_id))

    def forget_soon(self, replica_id: str) -> None:
        """Unregister a replica that failed, without waiting (called from a pool's callback)."""
        call = asyncio.ensure_future(self.unregister_generator(replica_id))
        self._forgetting.add(call)
        call.add_done_callback(self._forget_done)

    def _forget_done(self, call: asyncio.Future) -> None:
        self._forgetting.discard(call)
        if not call.cancelled() and call.exception() is not None:
            logger.warning("unregistering a failed generator: %s", call.exception())

    async def _forgotten(self) -> None:
        """Wait for the unregistrations under way. The learner takes calls in any order: a push
        that overtook one would broadcast to a dead member's group (and fail for every replica),
        and a registration that overtook one would be undone by it. ``asyncio.wait``, not
        ``gather``: a waiter that is cancelled must not cancel the calls for the others."""
        if self._forgetting:
            await asyncio.wait(set(self._forgetting), timeout=self.deadline)

    async def train_step(self, run_id: str, step: int, samples: list) -> lp.TrainStepResponse:
        return await self._call("TrainStep", lp.TrainStepRequest(run_id=run_id, step=step, samples=samples))

    async def push_weights(self, version: int) -> lp.PushWeightsResponse:
        await self._forgotten()
        return await self._call("PushWeights", lp.PushWeightsRequest(version=version))

    async def save_checkpoint(self, path: str, tag: str, client_state_json: str) -> lp.SaveCheckpointResponse:
        req = lp.SaveCheckpointRequest(path=path, tag=tag, client_state_json=client_state_json)
        return await self._call("SaveCheckpoint", req)

    async def compute_values(self, run_id: str, sequences: list[lp.TokenSequence]) -> list[list[float]]:
        resp = await self._call("ComputeValues", lp.ComputeValuesRequest(run_id=run_id, sequences=sequences))
        return [list(v.values) for v in resp.values]

    async def compute_logprobs(self, run_id: str, sequences: list[lp.TokenSequence]) -> list[list[float]]:
        req = lp.ComputeLogprobsRequest(run_id=run_id, sequences=sequences)
        resp = await self._call("ComputeLogprobs", req)
        return [list(v.values) for v in resp.logprobs]

    async def load_checkpoint(self, path: str, tag: str) -> lp.LoadCheckpointResponse:
        return await self._call("LoadCheckpoint", lp.LoadCheckpointRequest(path=path, tag=tag))

    async def close(self) -> None:
        await self.channel.close()
