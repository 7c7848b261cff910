"""Clients of the services, as the coordinator uses them: deadlines on every call, work spread
over replicas, and a failed replica's work re-issued to the others. A learner (the actor, and the
critic and reference of PPO) is one service with one address (``LearnerClient``).

Generate is spread by prompt: each healthy replica gets a share of the prompts. If a replica's
call fails (it died, or its deadline passed), its prompts whose groups are not complete are sent
again to the replicas still healthy; samples are keyed by (prompt_id, sample_index) and a
partial group from a failed call is discarded, so no prompt is lost or counted twice. A call
that ends OK without all of a prompt's samples, or a Score answer that does not match its items
one for one, is a replica failing its contract: treated as a failed call, never used. Score is
stateless and is re-issued the same way by chunks. A failed replica is probed and comes back into
rotation when it serves again (``rotation.py``); with none left, calls wait for one. Work that
fails ``max_attempts`` times (a prompt that kills every generator it reaches, a replica that
fails and comes back healthy again and again) ends the run with ``AttemptsExhausted``, naming
the replicas and their errors, instead of being sent again forever. Channels speak TLS and carry
the bearer token as ``services.security`` says.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from relayrl.common import logcontext
from relayrl.common.affinity import ranked
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.errors import AttemptsExhausted, ServiceRpcError
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
DOWN_CODES = {
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


def rendezvous(key: str, reps: Sequence[Replica]) -> Replica:
    """The replica ``key`` goes to (``affinity.ranked``): it keeps it while that replica is in
    rotation.

    >>> reps = [Replica(f"gen-{i}", "", None) for i in range(3)]
    >>> rendezvous("e1", reps).name == rendezvous("e1", reps[::-1]).name
    True
    """
    by_name = {rep.name: rep for rep in reps}
    return by_name[ranked(key, by_name)[0]]


def _split(items: Sequence, parts: int) -> list[list]:
    return [list(items[i::parts]) for i in range(parts)]


class Attempts:
    """Failed tries per piece of work, with their reasons; ``failed`` raises
    ``AttemptsExhausted`` at the ``limit``-th failure of one piece."""

    def __init__(self, what: str, limit: int):
        self.what, self.limit = what, limit
        self.errors: dict[str, list[str]] = {}

    def failed(self, key: str, why: str) -> None:
        errors = self.errors.setdefault(key, [])
        errors.append(why[:300])
        if len(errors) >= self.limit:
            raise AttemptsExhausted(
                f"{self.what} {key[:100]} failed on all {self.limit} attempts (services.max_attempts): "
                + "; ".join(errors)
            )


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
        max_attempts: int = 4,
        coming_back: Callable[[str], bool] | None = None,
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
            call_deadline_s=deadline_s,
            coming_back=coming_back,
        )
        self.deadline_s = deadline_s
        self.samples_per_call = samples_per_call
        self.max_attempts = max_attempts

    async def generate(
        self,
        prompts: list[common_pb2.Prompt],
        sampling: g.SamplingParams,
        request_id: str,
        min_version: int = 0,
        affinity: str = "",
    ) -> dict[str, list[common_pb2.Sample]]:
        """All ``sampling.n`` samples of every prompt, grouped by prompt_id. ``min_version``:
        the policy version every replica in rotation holds (the last one pushed); a replica
        that samples with an older one restarted between two calls (it serves the weights it
        loaded): it leaves the rotation, to come back at the current weights, and its prompts
        go to the others. ``affinity``: every call with the same key goes to the same replica
        while it is in rotation (a multi-turn episode's turns then find their prefix in its
        cache); other keys spread evenly over the replicas."""
        done: dict[str, dict[int, common_pb2.Sample]] = {}
        todo = list(prompts)
        attempt = 0
        tries = Attempts("generator: prompt", self.max_attempts)
        while todo:
            reps = await self.available()
            if affinity:
                reps = [rendezvous(affinity, reps)]
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
            for (rep, _), (got, failed, why) in zip(calls, results, strict=True):
                done.update(got)
                for p in failed:
                    tries.failed(p.prompt_id, f"{rep.name}: {why}")
                todo += failed
            attempt += 1
        return {pid: [s[i] for i in sorted(s)] for pid, s in done.items()}

    async def check_chat(self, tools_json: str, tool_format: str) -> g.CheckChatResponse:
        """What a replica's chat template does with these tools and with turns appended
        (GeneratorService.CheckChat). Every replica serves the same model folder, so one answers
        for all."""
        rep = (await self.available())[0]
        try:
            return await gg.GeneratorServiceStub(rep.channel).CheckChat(
                g.CheckChatRequest(tools_json=tools_json, tool_format=tool_format),
                timeout=self.deadline_s,
                metadata=logcontext.current(),
            )
        except grpc.aio.AioRpcError as e:
            raise ServiceRpcError(e, f"generator {rep.name} ({rep.address})", "CheckChat") from None

    async def _call(
        self, rep: Replica, share: list, sampling: g.SamplingParams, rid: str, min_version: int
    ) -> tuple[dict[str, dict[int, common_pb2.Sample]], list[common_pb2.Prompt], str]:
        """One Generate call: the prompts it completed (all n samples), those to send again, and
        why they failed."""
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
                why = f"sampled with policy version {oldest}, not {min_version}: restarted?"
                self.mark_down(rep, why)
                return {}, share, why
            why = "answered OK without all samples of the prompt (a generator bug)"
        except grpc.aio.AioRpcError as e:
            if e.code() not in DOWN_CODES:  # a bad request: re-issuing it elsewhere would fail the same way
                raise ServiceRpcError(e, f"generator {rep.name} ({rep.address})", "Generate") from None
            why = f"{e.code().name}: {e.details()}"
        complete = {p.prompt_id: got[p.prompt_id] for p in share if _whole(got.get(p.prompt_id), sampling.n)}
        failed = [p for p in share if p.prompt_id not in complete]
        if failed:
            self.mark_down(rep, why)
        return complete, failed, why


def _whole(samples: dict[int, common_pb2.Sample] | None, n: int) -> bool:
    """Whether a prompt's samples are all there: indices 0 .. n-1, each once."""
    return samples is not None and sorted(samples) == list(range(n))


class RewardPool(Rotation):
    def __init__(
        self,
        replicas: dict[str, str],
        deadline_s: float,
        chunk: int = 256,
        security: ClientSecurity | None = None,
        wait_s: float = 600.0,
        probe_s: float = 5.0,
        max_attempts: int = 4,
        coming_back: Callable[[str], bool] | None = None,
    ):
        super().__init__(
            "reward",
            replicas,
            "relayrl.reward.v1.RewardService",
            security,
            probe_s=probe_s,
            wait_s=wait_s,
            call_deadline_s=deadline_s,
            coming_back=coming_back,
        )
        self.deadline_s = deadline_s
        self.chunk = chunk
        self.max_attempts = max_attempts

    async def score(self, items: list[rw.RewardInput], request_id: str) -> list[rw.RewardResult]:
        """Results in the order of ``items``."""
        chunks = [items[i : i + self.chunk] for i in range(0, len(items), self.chunk)]
        out: list[list[rw.RewardResult] | None] = [None] * len(chunks)
        pending = list(range(len(chunks)))
        tries = Attempts("reward: score chunk", self.max_attempts)
        while pending:
            reps = await self.available()
            sent = [(c, reps[k % len(reps)]) for k, c in enumerate(pending)]
            answers = await asyncio.gather(
                *(self._call(rep, chunks[c], f"{request_id}-{c}") for c, rep in sent)
            )
            still = []
            for (c, rep), a in zip(sent, answers, strict=True):
                if isinstance(a, str):
                    still.append(c)  # its replica failed: re-issued to the others
                    tries.failed(f"{request_id}-{c}", f"{rep.name}: {a}")
                else:
                    out[c] = a
            pending = still
        return [r for chunk in out for r in chunk]  # type: ignore[union-attr]

    async def _call(self, rep: Replica, chunk: list, rid: str) -> list[rw.RewardResult] | str:
        """The chunk's results in its order, or why the replica failed it."""
        try:
            resp = await rwg.RewardServiceStub(rep.channel).Score(
                rw.ScoreRequest(request_id=rid, items=chunk),
                timeout=self.deadline_s,
                metadata=logcontext.current(),
            )
        except grpc.aio.AioRpcError as e:
            if e.code() not in DOWN_CODES:
                raise ServiceRpcError(e, f"reward {rep.name} ({rep.address})", "Score") from None
            why = f"{e.code().name} {e.details()}"
        else:
            if [r.sample_id for r in resp.results] == [x.sample_id for x in chunk]:
                return list(resp.results)
            # Results out of step with the items would give samples each other's rewards.
            why = f"answered {len(resp.results)} results for {len(chunk)} items, not one per item in order"
        self.mark_down(rep, why)
        return why


class LearnerClient:
    """A learner's rank 0 as the coordinator calls it (the actor, or PPO's critic or reference:
    ``name``): one channel, the deadline on every call, and every error naming the learner and
    the call (``ServiceRpcError``)."""

    def __init__(
        self, address: str, deadline: float, security: ClientSecurity | None = None, name: str = "learner"
    ):
        self.channel = client_channel(address, security, _OPTIONS)
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
