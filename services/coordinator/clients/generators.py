"""The generators as the coordinator calls them: a rotation of generator replicas, Generate spread
over them by prompt, the chat template checked (CheckChat), and the policy version of a sample.

Generate is spread by prompt: each healthy replica gets a share of the prompts. If a replica's
call fails (it died, or its deadline passed), its prompts whose groups are not complete are sent
again to the replicas still healthy; samples are keyed by (prompt_id, sample_index) and a
partial group from a failed call is discarded, so no prompt is lost or counted twice. A call
that ends OK without all of a prompt's samples is a replica failing its contract: treated as a
failed call, never used. A failed replica is probed and comes back into rotation when it serves
again (``rotation.py``: a generator after its readmission, which gives it the current weights);
with none left, calls wait for one. A prompt that fails ``max_attempts`` times (one that kills
every generator it reaches, a replica that fails and comes back healthy again and again) ends the
run with ``AttemptsExhausted``, naming the replicas and their errors, instead of being sent again
forever. Channels speak TLS and carry the bearer token as ``services.security`` says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import grpc
from relayrl.common import logcontext
from relayrl.common.serving import ClientSecurity
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.rotation import (
    DOWN_CODES,
    PROBE_TIMEOUT_S,
    Attempts,
    Replica,
    Rotation,
    rendezvous,
)
from relayrl.coordinator.errors import ServiceRpcError
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg


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
