"""The coordinator's generator pool (``coordinator/clients.py``) against real GeneratorService
servers on fake engines: a batch larger than one call may carry goes as several calls, none over
the bound, and every sample of every prompt comes back once."""

from __future__ import annotations

from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients import GeneratorPool
from relayrl.generator.v1 import generator_pb2 as g

from tests.unit.test_generator_servicer import FakeEngine, serving


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
