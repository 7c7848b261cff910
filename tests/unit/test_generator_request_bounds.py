"""What one Generate request may make a generator do before it is refused (issue #27): a prompt
of token ids longer than the model's context is refused before its ids are copied or scanned,
so a request of millions of ids costs no CPU (before: 25M ids took 6.5 s of the process's CPU
and GIL, and health checks failed meanwhile)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from relayrl.common.v1 import common_pb2 as c
from relayrl.generator.v1 import generator_pb2 as g

from tests.kit.generator import FakeEngine, serving


async def test_a_prompt_longer_than_the_context_is_refused_before_its_ids_are_read():
    async with serving(FakeEngine(), serve={"max_message_mb": 64}) as s:  # the fake's context: 64
        huge = c.Prompt(prompt_id="huge", token_ids=c.TokenIds(ids=[7] * 5_000_000))
        request = g.GenerateRequest(prompts=[huge], sampling=g.SamplingParams(n=1))
        call = s.stub.Generate(request, timeout=30)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.details() == "prompt 'huge': 5000000 tokens; the model takes at most 63"
        else:
            raise AssertionError("a prompt of 5M ids was accepted")
        assert not s.engine.calls
        edge = c.Prompt(prompt_id="edge", token_ids=c.TokenIds(ids=[7] * 63))  # fits: one token of room
        ok = [
            r
            async for r in s.stub.Generate(
                g.GenerateRequest(prompts=[edge], sampling=g.SamplingParams(n=1, max_tokens=1)), timeout=30
            )
        ]
        assert ok
        health = await s.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
