"""Clients of the services, as the coordinator uses them: deadlines on every call, work spread
over replicas, and a failed replica's work re-issued to the others. A learner (the actor, and the
critic and reference of PPO) is one service with one address (``LearnerClient``).

Generate is spread by prompt: each healthy replica gets a share of the prompts. If a replica's
call fails (it died, or its deadline passed), its prompts whose groups are not complete are sent
again to the replicas still healthy; samples are keyed by (prompt_id, sample_index) and a
partial group from a failed call is discarded, so no prompt is lost or counted twice. Score is
stateless and is re-issued the same way by chunks. A failed replica is probed and comes back into
rotation when it serves again (``rotation.py``); with none left, calls wait for one. Channels speak TLS and carry the bearer token
as ``services.security`` says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from relayrl.common import logcontext
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.rotation import OPTIONS as _OPTIONS
from relayrl.coordinator.rotation import PROBE_TIMEOUT_S, Replica, Rotation
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg
from relayrl.reward.v1 import reward_pb2 as rw
from relayrl.reward.v1 import reward_pb2_grpc as rwg

logger = logging.getLogger(__name__)
# Codes after which a replica is taken out of rotation (it is gone or not serving).
_DOWN = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


def version_of(s: common_pb2.Sample) -> int:
    """The oldest policy version that produced any token of the sample."""
    return min([s.policy_version, *(sp.version for sp in s.version_spans)])


async def waits_for_weights(channel: grpc.aio.Channel) -> bool:
    """Whether a generator that is not ready is up and only waiting for weights: its engine is
    loaded (it knows its context length) and it is not mid swap. That is a replica whose load was
    broken half-way (a peer of its broadcast group died): only a complete push makes it ready."""
    try:
        st = await gg.GeneratorServiceStub(channel).GetStatus(
            g.GetStatusRequest(), timeout=PROBE_TIMEOUT_S, metadata=logcontext.current()
        )
    except grpc.aio.AioRpcError:
        return False
    return not st.ready and not st.swapping and st.max_model_len > 0


def _split(items: Sequence, parts: int) -> list[list]:
    return [list(items[i::parts]) for i in range(parts)]


class GeneratorPool(Rotation):
    def __init__(
        self,
        replicas: dict[str, str],
        deadline_s: float,
        on_down: Callable[[str], None] | None = None,
        security: ClientSecurity | None = None,
        readmit: Callable[[str, str], Awaitable[None]] | None = None,
        wait_s: float = 600.0,
        probe_s: float = 5.0,
        samples_per_call: int = 4096,
    ):
        """``samples_per_call``: a replica's share of a batch goes as several concurrent calls
        of at most this many samples (a generator refuses more than its
        ``max_samples_per_request``); vLLM batches them together all the same."""
        super().__init__(
            "generator",
            replicas,
            "relayrl.generator.v1.GeneratorService",
            security,
            readmit=readmit,
            on_down=on_down,
            probe_s=probe_s,
            wait_s=wait_s,
            admit_unready=waits_for_weights,
        )
        self.deadline_s = deadline_s
        self.samples_per_call = samples_per_call

    async def generate(
        self,
        prompts: list[common_pb2.Prompt],
        sampling: g.SamplingParams,
        request_id: str,
        min_version: int = 0,
    ) -> dict[str, list[common_pb2.Sample]]:
        """All ``sampling.n`` samples of every prompt, grouped by prompt_id. ``min_version``:
        the policy version every replica in rotation holds (the last one pushed); a replica
        that samples with an older one restarted between two calls (it serves the weights it
        loaded): it leaves the rotation, to come back at the current weights, and its prompts
        go to the others."""
        done: dict[str, dict[int, common_pb2.Sample]] = {}
        todo = list(prompts)
        attempt = 0
        while todo:
            reps = await self.available()
            per_call = max(1, self.samples_per_call // max(1, sampling.n))
            calls = [
                (rep, share[k : k + per_call])
                for rep, share in zip(reps, _split(todo, len(reps)), strict=True)
                for k in range(0, len(share), per_call)
            ]
            results = await asyncio.gather(
                *(
                    self._call(rep, part, sampling, f"{request_id}-a{attempt}-{i}", min_version)
                    for i, (rep, part) in enumerate(calls)
                )
            )
            todo = []
            for got, failed in results:
                for pid, samples in got.items():
                    if len(samples) == sampling.n:
                        done[pid] = samples
                todo += [p for p in failed if p.prompt_id not in done]
            attempt += 1
        return {pid: [s[i] for i in sorted(s)] for pid, s in done.items()}

    async def _call(self, rep: Replica, share: list, sampling: g.SamplingParams, rid: str, min_version: int):
        got: dict[str, dict[int, common_pb2.Sample]] = {}
        stub = gg.GeneratorServiceStub(rep.channel)
        try:
            call = stub.Generate(
                g.GenerateRequest(request_id=rid, prompts=share, sampling=sampling),
                timeout=self.deadline_s,
                metadata=logcontext.current(),
            )
            async for resp in call:
                for s in resp.samples:
                    got.setdefault(s.prompt_id, {})[s.sample_index] = s
            oldest = min((version_of(s) for v in got.values() for s in v.values()), default=min_version)
            if oldest < min_version:
                self.mark_down(rep, f"sampled with policy version {oldest}, not {min_version}: restarted?")
                return {}, share
            return got, []
        except grpc.aio.AioRpcError as e:
            if e.code() not in _DOWN:
                raise  # a bad request: re-issuing it elsewhere would fail the same way
            self.mark_down(rep, f"{e.code().name}: {e.details()}")
            complete = {pid: s for pid, s in got.items() if len(s) == sampling.n}
            return complete, [p for p in share if p.prompt_id not in complete]


class RewardPool(Rotation):
    def __init__(
        self,
        replicas: dict[str, str],
        deadline_s: float,
        chunk: int = 256,
        security: ClientSecurity | None = None,
        wait_s: float = 600.0,
        probe_s: float = 5.0,
    ):
        super().__init__(
            "reward", replicas, "relayrl.reward.v1.RewardService", security, probe_s=probe_s, wait_s=wait_s
        )
        self.deadline_s = deadline_s
        self.chunk = chunk

    async def score(self, items: list[rw.RewardInput], request_id: str) -> list[rw.RewardResult]:
        """Results in the order of ``items``."""
        chunks = [items[i : i + self.chunk] for i in range(0, len(items), self.chunk)]
        out: list[list[rw.RewardResult] | None] = [None] * len(chunks)
        pending = list(range(len(chunks)))
        while pending:
            reps = await self.available()
            answers = await asyncio.gather(
                *(
                    self._call(reps[k % len(reps)], chunks[c], f"{request_id}-{c}")
                    for k, c in enumerate(pending)
                )
            )
            still = []
            for c, a in zip(pending, answers, strict=True):
                if a is None:
                    still.append(c)  # its replica failed: re-issued to the others
                else:
                    out[c] = a
            pending = still
        return [r for chunk in out for r in chunk]  # type: ignore[union-attr]

    async def _call(self, rep: Replica, chunk: list, rid: str) -> list[rw.RewardResult] | None:
        try:
            resp = await rwg.RewardServiceStub(rep.channel).Score(
                rw.ScoreRequest(request_id=rid, items=chunk),
                timeout=self.deadline_s,
                metadata=logcontext.current(),
            )
            return list(resp.results)
        except grpc.aio.AioRpcError as e:
            if e.code() not in _DOWN:
                raise
            self.mark_down(rep, f"{e.code().name} {e.details()}")
            return None


class LearnerClient:
    """The learner's rank 0 as the coordinator calls it: one channel, the deadline on every call."""

    def __init__(self, address: str, deadline: float, security: ClientSecurity | None = None):
        self.channel = client_channel(address, security, _OPTIONS)
        self.stub = lg.LearnerServiceStub(self.channel)
        self.deadline = deadline
        self._forgetting: set[asyncio.Future] = set()  # UnregisterGenerator calls under way

    async def register_generator(self, replica_id: str, address: str) -> lp.RegisterGeneratorResponse:
        await self._forgotten()
        req = lp.RegisterGeneratorRequest(address=address, replica_id=replica_id)
        return await self.stub.RegisterGenerator(req, timeout=self.deadline, metadata=logcontext.current())

    async def unregister_generator(self, replica_id: str) -> None:
        req = lp.UnregisterGeneratorRequest(replica_id=replica_id)
        await self.stub.UnregisterGenerator(req, timeout=self.deadline, metadata=logcontext.current())

    def forget_soon(self, replica_id: str) -> None:
        """Unregister a replica that failed, without waiting (called from a pool's callback)."""
        req = lp.UnregisterGeneratorRequest(replica_id=replica_id)
        call = asyncio.ensure_future(
            self.stub.UnregisterGenerator(req, timeout=self.deadline, metadata=logcontext.current())
        )
        self._forgetting.add(call)
        call.add_done_callback(self._forget_done)

    def _forget_done(self, call: asyncio.Future) -> None:
        self._forgetting.discard(call)
        if not call.cancelled() and call.exception() is not None:
            logger.warning("unregistering a failed generator: %s", call.exception())

    async def _forgotten(self) -> None:
        """Wait for the unregistrations under way. The learner takes calls in any order: a push
        that overtook one would broadcast to a dead member's group (and fail for every replica),
        and a registration that overtook one would be undone by it."""
        if self._forgetting:
            await asyncio.gather(*self._forgetting, return_exceptions=True)

    async def train_step(self, run_id: str, step: int, samples: list) -> lp.TrainStepResponse:
        req = lp.TrainStepRequest(run_id=run_id, step=step, samples=samples)
        return await self.stub.TrainStep(req, timeout=self.deadline, metadata=logcontext.current())

    async def push_weights(self, version: int) -> lp.PushWeightsResponse:
        await self._forgotten()
        return await self.stub.PushWeights(
            lp.PushWeightsRequest(version=version), timeout=self.deadline, metadata=logcontext.current()
        )

    async def save_checkpoint(self, path: str, tag: str, client_state_json: str) -> lp.SaveCheckpointResponse:
        req = lp.SaveCheckpointRequest(path=path, tag=tag, client_state_json=client_state_json)
        return await self.stub.SaveCheckpoint(req, timeout=self.deadline, metadata=logcontext.current())

    async def compute_values(self, run_id: str, sequences: list[lp.TokenSequence]) -> list[list[float]]:
        req = lp.ComputeValuesRequest(run_id=run_id, sequences=sequences)
        resp = await self.stub.ComputeValues(req, timeout=self.deadline, metadata=logcontext.current())
        return [list(v.values) for v in resp.values]

    async def compute_logprobs(self, run_id: str, sequences: list[lp.TokenSequence]) -> list[list[float]]:
        req = lp.ComputeLogprobsRequest(run_id=run_id, sequences=sequences)
        resp = await self.stub.ComputeLogprobs(req, timeout=self.deadline, metadata=logcontext.current())
        return [list(v.values) for v in resp.logprobs]

    async def load_checkpoint(self, path: str, tag: str) -> lp.LoadCheckpointResponse:
        return await self.stub.LoadCheckpoint(
            lp.LoadCheckpointRequest(path=path, tag=tag), timeout=self.deadline
        )

    async def close(self) -> None:
        await self.channel.close()
