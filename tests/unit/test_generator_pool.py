"""The coordinator's pools (``coordinator/clients/generators.py``, ``rewards.py``) against real
GeneratorService and RewardService servers on fake engines: a batch larger than one call may carry
goes as several calls, none over the bound, and every sample of every prompt comes back once; an
answer that breaks the contract is never used; work that fails every time ends the run, named,
instead of being sent again forever."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from relayrl.common.rpc import Unavailable
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.rewards import RewardPool
from relayrl.coordinator.errors import AttemptsExhausted
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.reward.v1 import reward_pb2 as rw
from relayrl.reward.v1 import reward_pb2_grpc as rwg

from tests.kit.generator import FakeEngine, serving


def _prompts(k: int) -> list[common_pb2.Prompt]:
    return [common_pb2.Prompt(prompt_id=f"p{i}", text=f"question {i}") for i in range(k)]


async def test_an_evaluation_larger_than_a_generators_limit_goes_in_calls_it_accepts():
    """50 prompts x n=4 = 200 samples to two replicas that each accept at most 32 per request
    (a held-out set x eval_samples can pass a real generator's 16384): calls of at most 32."""
    engines = [FakeEngine(delay=0), FakeEngine(delay=0)]
    async with (
        serving(engines[0], max_samples_per_request=32) as a,
        serving(engines[1], max_samples_per_request=32) as b,
    ):
        pool = GeneratorPool(
            {"gen-0": f"127.0.0.1:{a.handle.port}", "gen-1": f"127.0.0.1:{b.handle.port}"},
            deadline_s=30,
            samples_per_call=32,
        )
        try:
            got = await pool.generate(_prompts(50), g.SamplingParams(n=4, max_tokens=8), request_id="eval0")
        finally:
            await pool.close()
    assert sorted(got) == sorted(f"p{i}" for i in range(50))
    assert all([s.sample_index for s in v] == [0, 1, 2, 3] for v in got.values())
    calls = [c for e in engines for c in e.calls]
    assert all(len(prompts) * 4 <= 32 for _, prompts, _ in calls)
    assert len(calls) >= 7 and all(e.calls for e in engines)  # 200 / 32, over both replicas
    assert sorted(p.prompt_id for _, prompts, _ in calls for p in prompts) == sorted(got)  # each once


async def test_a_prompt_that_fails_every_time_ends_the_run_named_not_retried_forever():
    """The replica fails the call, is probed SERVING a moment later, readmitted, and fails the
    same work again: without a bound this goes on forever with no error shown."""
    engine = FakeEngine(delay=0)
    engine.fail = Unavailable("engine is not ready")
    async with serving(engine) as a:
        pool = GeneratorPool(
            {"gen-0": f"127.0.0.1:{a.handle.port}"}, deadline_s=10, probe_s=0.05, max_attempts=3
        )
        try:
            with pytest.raises(AttemptsExhausted) as e:
                await asyncio.wait_for(pool.generate(_prompts(1), g.SamplingParams(n=2), request_id="s1"), 20)
        finally:
            await pool.close()
    assert len(engine.calls) == 3
    assert "generator: prompt p0 failed on all 3 attempts" in str(e.value) and "gen-0: UNAVAILABLE" in str(
        e.value
    )


class Short(FakeEngine):
    """Ends its first stream OK with a sample missing (a contract the servicer cannot check)."""

    async def generate(self, request_id, prompts, spec):
        first = not self.calls
        k = 0
        async for s in super().generate(request_id, prompts, spec):
            k += 1
            if first and k == 2:
                continue
            yield s


async def test_a_stream_that_ends_ok_without_all_samples_is_sent_again_not_a_lost_prompt():
    engine = Short(delay=0)
    async with serving(engine) as a:
        pool = GeneratorPool({"gen-0": f"127.0.0.1:{a.handle.port}"}, deadline_s=10, probe_s=0.05)
        try:
            got = await asyncio.wait_for(
                pool.generate(_prompts(2), g.SamplingParams(n=2), request_id="s1"), 20
            )
        finally:
            await pool.close()
    assert sorted(got) == ["p0", "p1"] and all([s.sample_index for s in v] == [0, 1] for v in got.values())
    assert [p.prompt_id for p in engine.calls[1][1]] == ["p0"]  # only the short prompt again


class Scorer(rwg.RewardServiceServicer):
    """Scores every item 1.0; its first ``bad`` answers come in the wrong order."""

    def __init__(self, bad: int):
        self.bad, self.calls = bad, 0

    async def Score(self, request, context):
        self.calls += 1
        results = [
            rw.RewardResult(sample_id=x.sample_id, reward=1.0, status=rw.SCORE_STATUS_OK)
            for x in request.items
        ]
        return rw.ScoreResponse(results=results[::-1] if self.calls <= self.bad else results)


async def _scoring(scorer: Scorer, max_attempts: int):
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server()
    rwg.add_RewardServiceServicer_to_server(scorer, server)
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    await h.set("relayrl.reward.v1.RewardService", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    items = [rw.RewardInput(sample_id=f"p/{i}", completion=str(i)) for i in range(3)]
    pool = RewardPool({"reward-0": f"127.0.0.1:{port}"}, 10, probe_s=0.05, max_attempts=max_attempts)
    try:
        return await asyncio.wait_for(pool.score(items, "s1"), 20)
    finally:
        await pool.close()
        await server.stop(None)


async def test_scores_out_of_step_with_their_items_are_never_used():
    """Results in another order would give each sample another's reward, silently."""
    got = await _scoring(Scorer(bad=1), max_attempts=3)
    assert [r.sample_id for r in got] == ["p/0", "p/1", "p/2"]
    with pytest.raises(AttemptsExhausted, match="not one per item in order"):
        await _scoring(Scorer(bad=10), max_attempts=2)
