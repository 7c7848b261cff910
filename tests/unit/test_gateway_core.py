"""The gateway's sessions as the HTTP layer and the coordinator use them (``gateway/core.py``),
over a stand-in for the generators: who may set a reward, admission per session and in all,
``tool_choice: none``, sessions never swept while a request is sampled, a bounded memory of
closed sessions; and the generators' client (``gateway/upstream.py``) answering 429 while the
only replica up still waits for the session's policy version."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from relayrl.common.serving import ClientSecurity
from relayrl.gateway.api import Busy, ChatRequest, Forbidden, RewardSet, Unavailable
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.core import GatewayCore
from relayrl.gateway.upstream import Generators
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg

from tests.unit.test_gateway_sessions import STOP, SYSTEM, TOOLS, USER, sample


class Upstream:
    """The generators: each call waits for ``gate`` (when set), then answers one plain turn."""

    def __init__(self):
        self.gate: asyncio.Event | None = None
        self.sampling: list[g.SamplingParams] = []

    async def generate(self, prompt, sampling, affinity, min_version, rid):
        self.sampling.append(sampling)
        if self.gate is not None:
            await self.gate.wait()
        return sample([1, 2], [10, STOP])


def core(**cfg) -> tuple[GatewayCore, Upstream]:
    up = Upstream()
    return GatewayCore(GatewayConfig(**cfg), up), up


def open_(c: GatewayCore, **kw) -> str:
    sampling = g.SamplingParams(max_tokens=16, stop_token_ids=[STOP], tool_format="hermes")
    return c.open(gw.OpenSessionRequest(episode_id="p/0", sampling=sampling, **kw)).session_key


REQ = ChatRequest([SYSTEM, USER], TOOLS)


def test_the_agent_sets_its_reward_only_where_its_session_allows_it():
    c, _ = core()
    closed_to_agent, open_to_agent = open_(c), open_(c, agent_reward=True)
    with pytest.raises(Forbidden):
        c.set_reward(closed_to_agent, RewardSet(1.0), by_agent=True)
    c.set_reward(closed_to_agent, RewardSet(0.5))  # the gRPC SetReward: a harness out of reach
    c.set_reward(open_to_agent, RewardSet(1.0), by_agent=True)
    assert c.close(closed_to_agent).reward == 0.5 and c.close(open_to_agent).reward == 1.0


async def test_one_session_cannot_take_every_slot_and_a_full_gateway_says_429():
    c, up = core(max_in_flight=3, max_in_flight_per_session=2, retry_after_seconds=7)
    up.gate = asyncio.Event()
    a, b = open_(c), open_(c)
    first = [asyncio.ensure_future(c.complete(a, REQ)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Busy, match="max_in_flight_per_session") as e:
        await c.complete(a, REQ)
    assert e.value.retry_after == 7
    other = asyncio.ensure_future(c.complete(b, REQ))  # another session still gets in
    await asyncio.sleep(0)
    with pytest.raises(Busy, match="gateway max_in_flight"):
        await c.complete(b, REQ)
    up.gate.set()
    await asyncio.gather(*first, other)
    assert c.in_flight == 0 and c.sessions[a].in_flight == 0


async def test_tool_choice_none_reads_no_calls_out_of_the_answer():
    c, up = core()
    key = open_(c)
    await c.complete(key, ChatRequest([SYSTEM, USER], TOOLS, tool_choice="none"))
    await c.complete(key, ChatRequest([SYSTEM, USER], TOOLS))
    assert [s.tool_format for s in up.sampling] == ["", "hermes"]


async def test_a_session_with_a_request_being_sampled_is_not_swept():
    c, up = core()
    up.gate = asyncio.Event()
    key = open_(c, ttl_seconds=0.01)
    call = asyncio.ensure_future(c.complete(key, REQ))
    await asyncio.sleep(0.05)  # past its TTL, but sampling
    c.sweep()
    assert key in c.sessions
    up.gate.set()
    await call
    c.sweep()  # its TTL counts from the answer
    assert key in c.sessions
    await asyncio.sleep(0.05)
    c.sweep()
    assert key not in c.sessions


def test_closed_sessions_are_remembered_within_bounds():
    c, _ = core(max_sessions=2)
    keys = []
    for _ in range(4):
        keys.append(open_(c))
        c.close(keys[-1])
    assert list(c.closed) == keys[2:]  # the newest max_sessions answers; a retried close finds them
    assert c.close(keys[3]) is c.closed[keys[3]][1]


class StaleGenerator(gg.GeneratorServiceServicer):
    """A replica that restarted and serves policy version 1 until its weights arrive."""

    async def Generate(self, request, context):
        yield g.GenerateResponse(samples=[sample([1], [10, STOP])])  # policy_version 3


async def test_a_replica_still_waiting_for_the_sessions_policy_is_a_429_not_a_503():
    server = grpc.aio.server()
    gg.add_GeneratorServiceServicer_to_server(StaleGenerator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gens = Generators([f"127.0.0.1:{port}"], ClientSecurity(), 10, 2.0)
    try:
        ok = await gens.generate(g.GenerateRequest().prompts.add(), g.SamplingParams(), "p/0", 3, "r1")
        assert ok.policy_version == 3
        with pytest.raises(Busy, match="policy version 3, not 4") as e:
            await gens.generate(g.GenerateRequest().prompts.add(), g.SamplingParams(), "p/0", 4, "r2")
        assert e.value.retry_after == 2.0
        await server.stop(0)  # and a replica that is gone is a 503
        with pytest.raises(Unavailable):
            await gens.generate(g.GenerateRequest().prompts.add(), g.SamplingParams(), "p/0", 0, "r3")
    finally:
        await gens.close()
        await server.stop(0)


async def test_tool_choice_none_answers_the_whole_text():
    c, up = core()
    key = open_(c)

    async def text_reply(prompt, sampling, affinity, min_version, rid):
        s = sample([1, 2], [10, STOP], text="<tool_call>{...}</tool_call> 42")
        s.content = ""  # no tool format: the generator read no calls, so no content apart
        return s

    up.generate = text_reply
    answer = await c.complete(key, ChatRequest([SYSTEM, USER], TOOLS, tool_choice="none"))
    assert answer.message.content == "<tool_call>{...}</tool_call> 42" and not answer.message.tool_calls
