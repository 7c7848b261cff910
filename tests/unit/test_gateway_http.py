"""The gateway's HTTP layer (relayrl.gateway.http, openai_api) over a real aiohttp server on
127.0.0.1 port 0, in front of a fake ``Sessions``.

What is checked: the official ``openai`` client reads plain, tool-call and streamed answers (the
stream's deltas add up to the plain answer), and what it sends back (tool calls, tool answers)
arrives as the right ``ChatRequest``; curl gets JSON; every refusal is OpenAI's error body with
its status (400, 401, 404, 405, 413, 429 with Retry-After, 500, 504); rewards; metrics; a Unix
socket. And the server goes on serving after a crash in the sessions and after clients that
leave mid-body or mid-answer, which every test checks again on its way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import struct
from types import SimpleNamespace

import aiohttp
import httpx
import openai
import pytest
from prometheus_client import REGISTRY
from relayrl.common.v1 import common_pb2 as c
from relayrl.gateway.api import Answer, BadRequest, Busy, ChatRequest, RewardSet, Unauthorized
from relayrl.gateway.config import HttpConfig
from relayrl.gateway.http import make_app, serve_http
from relayrl.gateway.metrics import GatewayMetrics
from relayrl.gateway.openai_api import parse_chat_request

KEY = "rrl-test-key"
MODEL = "relayrl-policy"
CHAT = "/v1/chat/completions"
OK = c.TOOL_CALL_PARSE_OK
MAX_BODY = 1 << 20

PLAIN = Answer(
    c.ChatMessage(role="assistant", content="2 + 2 = 4."), "stop", 12, 6, "chatcmpl-plain", 1700000000
)
TOOLS = Answer(
    c.ChatMessage(
        role="assistant",
        content="Let me compute.",
        tool_calls=[
            c.ToolCall(id="call_0_0", name="calc", arguments_json='{"expression": "2+2"}', parse=OK),
            c.ToolCall(id="call_0_1", name="lookup", arguments_json='{"q": "four", "k": 3}', parse=OK),
        ],
    ),
    "tool_calls",
    30,
    20,
    "chatcmpl-tools",
    1700000001,
)
TOOLS_ONLY = Answer(
    c.ChatMessage(role="assistant", tool_calls=[c.ToolCall(id="call_1_0", name="calc", arguments_json="{}")]),
    "tool_calls",
    40,
    5,
    "chatcmpl-only",
    1700000002,
)
TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "What is 2 + 2?"}]


class FakeSessions:
    """One open session (``KEY``); answers ``self.answer``, or raises ``self.error`` once."""

    model = MODEL

    def __init__(self):
        self.answer = PLAIN
        self.error: BaseException | None = None
        self.gate: asyncio.Event | None = None
        """When set, ``complete`` waits for it (a slow generator)."""
        self.entered = asyncio.Event()
        self.requests: list[ChatRequest] = []
        self.rewards: list[RewardSet] = []

    def check_key(self, key: str) -> None:
        if key != KEY:
            raise Unauthorized("invalid API key")

    async def complete(self, key: str, request: ChatRequest) -> Answer:
        self.check_key(key)
        self.requests.append(request)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return self.answer

    def set_reward(self, key: str, reward: RewardSet, *, by_agent: bool = False) -> None:
        self.check_key(key)
        assert by_agent  # over HTTP it is always the agent (the session decides whether it may)
        self.rewards.append(reward)


class Recorder:
    """Metrics: every answered request, in order, also as a queue to wait on."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []
        self.queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self.refusals: list[str] = []

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        assert seconds >= 0
        self.seen.append((route, status))
        self.queue.put_nowait((route, status))

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)

    async def next_for(self, route: str) -> int:
        while True:
            seen_route, status = await asyncio.wait_for(self.queue.get(), 5)
            if seen_route == route:
                return status


@contextlib.asynccontextmanager
async def serving(metrics=None, unix_path: str | None = None, sessions=None, **http):
    """The app on 127.0.0.1 and a free port over ``sessions`` (a ``FakeSessions``); ``http``
    overrides ``HttpConfig`` fields (1 MiB bodies, 5 s timeouts by default)."""
    sessions, metrics = sessions or FakeSessions(), metrics or Recorder()
    config = dict(max_body_mb=MAX_BODY / (1 << 20), request_timeout_seconds=5.0, body_timeout_seconds=5.0)
    app = make_app(sessions, HttpConfig(**{**config, **http}), metrics=metrics)
    runner, port = await serve_http(app, "127.0.0.1", 0, unix_path=unix_path)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield SimpleNamespace(sessions=sessions, metrics=metrics, port=port, http=http)
            # Whatever the test did, the server still answers.
            sessions.gate = sessions.error = None
            async with http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
                assert r.status == 200, await r.text()
    finally:
        await runner.cleanup()


@pytest.fixture
async def gw():
    async with serving() as s:
        yield s


@contextlib.asynccontextmanager
async def openai_client(port: int):
    # trust_env=False: a proxy set in the environment must not see loopback traffic.
    async with (
        httpx.AsyncClient(trust_env=False) as http,
        openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=5, http_client=http
        ) as client,
    ):
        yield client


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def error_of(resp: aiohttp.ClientResponse) -> dict:
    assert resp.content_type == "application/json", await resp.text()
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert len(body["error"]["message"]) <= 1000
    return body["error"]


# -- the official client -------------------------------------------------------------------------


async def test_openai_client_reads_a_plain_answer_and_its_request_arrives_parsed(gw):
    async with openai_client(gw.port) as client:
        r = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "developer", "content": "Be brief."}, *USER],
            tools=TOOL_SPECS,
            max_tokens=64,
            temperature=0.3,  # accepted, ignored: the experiment sets sampling
            seed=7,
        )
    assert r.id == "chatcmpl-plain" and r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.content == "2 + 2 = 4." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (12, 6, 18)
    (req,) = gw.sessions.requests
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be brief."),
        ("user", "What is 2 + 2?"),
    ]
    assert req.tools_json == json.dumps(TOOL_SPECS) and req.max_tokens == 64 and not req.stream


async def test_openai_client_reads_tool_calls_and_sends_them_back(gw):
    gw.sessions.answer = TOOLS
    async with openai_client(gw.port) as client:
        r = await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOL_SPECS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me compute."
        call = msg.tool_calls[0]
        assert (call.id, call.type, call.function.name) == ("call_0_0", "function", "calc")
        assert json.loads(call.function.arguments) == {"expression": "2+2"}
        assert msg.tool_calls[1].function.name == "lookup"
        # An agent's next turn: its history with the assistant's calls and the tools' answers.
        history = [
            *USER,
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "call_0_0", "content": "4"},
            {"role": "tool", "tool_call_id": "call_0_1", "name": "lookup", "content": "four"},
        ]
        gw.sessions.answer = PLAIN
        await client.chat.completions.create(model=MODEL, messages=history, tools=TOOL_SPECS)
    assistant, tool0, tool1 = gw.sessions.requests[1].messages[1:]
    assert list(assistant.tool_calls) == list(TOOLS.message.tool_calls)
    assert assistant.content == "Let me compute."
    assert (tool0.role, tool0.tool_call_id, tool0.content) == ("tool", "call_0_0", "4")
    assert (tool1.tool_call_id, tool1.name) == ("call_0_1", "lookup")


async def test_openai_client_reads_tool_only_answer_with_null_content(gw):
    gw.sessions.answer = TOOLS_ONLY
    async with openai_client(gw.port) as client:
        r = await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOL_SPECS)
    assert r.choices[0].message.content is None
    assert r.choices[0].message.tool_calls[0].function.arguments == "{}"


@pytest.mark.parametrize("answer", [PLAIN, TOOLS, TOOLS_ONLY], ids=["plain", "tools", "tools_only"])
@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no_usage"])
async def test_openai_client_stream_adds_up_to_the_plain_answer(gw, answer, usage):
    gw.sessions.answer = answer
    kwargs = {"model": MODEL, "messages": USER, "tools": TOOL_SPECS}
    async with openai_client(gw.port) as client:
        plain = (await client.chat.completions.create(**kwargs)).choices[0]
        stream = await client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True} if usage else None
        )
        content, calls, finish, total, ids = "", {}, None, None, set()
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL
            ids.add(chunk.id)
            if chunk.usage is not None:
                total = chunk.usage.total_tokens
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = d.id or call["id"]
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
        # The SDK's own accumulator agrees.
        async with client.chat.completions.stream(**kwargs) as helper:
            final = await helper.get_final_completion()
    assert ids == {answer.id}
    assert content == (plain.message.content or "") and finish == plain.finish_reason
    expected = [
        {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
        for t in plain.message.tool_calls or []
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert total == (answer.prompt_tokens + answer.completion_tokens if usage else None)
    assert final.choices[0].message.content == plain.message.content
    assert [t.function.arguments for t in final.choices[0].message.tool_calls or []] == [
        e["arguments"] for e in expected
    ]
    assert gw.sessions.requests[1].stream


async def test_models_lists_the_one_model_to_a_session_key_only(gw):
    async with openai_client(gw.port) as client:
        models = [m.id async for m in client.models.list()]
    assert models == [MODEL]
    async with gw.http.get("/v1/models") as r:
        assert r.status == 401 and (await error_of(r))["code"] == "invalid_api_key"
    async with gw.http.get("/v1/models", headers=auth()) as r:
        assert await r.json() == {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "relayrl"}],
        }


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_gets_json(gw):
    body = json.dumps({"model": MODEL, "messages": USER})
    proc = await asyncio.create_subprocess_exec(
        *("curl", "-sS", "--noproxy", "*", "--max-time", "5", "-H", f"Authorization: Bearer {KEY}"),
        *("-H", "Content-Type: application/json", "-d", body, f"http://127.0.0.1:{gw.port}{CHAT}"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    assert json.loads(out)["choices"][0]["message"] == {"role": "assistant", "content": "2 + 2 = 4."}


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers", "status", "code", "param"),
    [
        (b'{"model": "x", "messages": [', auth(), 400, "invalid_request", None),
        (b"\xff\xfe not utf-8", auth(), 400, "invalid_request", None),
        (b"[" * 100_000, auth(), 400, "invalid_request", None),
        ({"model": "gpt-4o", "messages": USER}, auth(), 404, "model_not_found", "model"),
        ({"model": MODEL, "messages": USER}, {}, 401, "invalid_api_key", None),
        ({"model": MODEL, "messages": USER}, auth("rrl-wrong"), 401, "invalid_api_key", None),
        ({"model": MODEL, "messages": USER}, {"Authorization": f"Basic {KEY}"}, 401, "invalid_api_key", None),
        ({"model": MODEL, "messages": USER, "n": 2}, auth(), 400, "invalid_request", "n"),
        (
            {"model": MODEL, "messages": USER, "tool_choice": "required"},
            auth(),
            400,
            "invalid_request",
            "tool_choice",
        ),
        ({"model": MODEL, "messages": []}, auth(), 400, "invalid_request", "messages"),
        ({"model": MODEL}, auth(), 400, "invalid_request", "messages"),
        ({"messages": USER}, auth(), 400, "invalid_request", "model"),
        ({"model": MODEL, "messages": USER, "max_tokens": 0}, auth(), 400, "invalid_request", "max_tokens"),
        ({"model": MODEL, "messages": USER, "stream": "yes"}, auth(), 400, "invalid_request", "stream"),
        ([1, 2], auth(), 400, "invalid_request", "body"),
    ],
    ids=[
        "malformed_json",
        "not_utf8",
        "deeply_nested",
        "unknown_model",
        "no_key",
        "wrong_key",
        "not_bearer",
        "n_2",
        "tool_choice_required_without_tools",
        "no_messages",
        "messages_missing",
        "model_missing",
        "max_tokens_0",
        "stream_not_bool",
        "body_not_object",
    ],
)
async def test_bad_requests_get_openai_errors(gw, body, headers, status, code, param):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with gw.http.post(CHAT, headers=headers, **kwargs) as r:
        assert r.status == status
        err = await error_of(r)
    assert (err["code"], err["param"]) == (code, param)
    assert gw.sessions.requests == []


async def test_a_body_past_the_limit_is_413_json_declared_or_chunked(gw):
    # Clients that send their whole body before reading (httpx, under the openai SDK): the server
    # answers 413 early and discards the rest of the body, so the client reads the answer.
    async with openai_client(gw.port) as client:
        with pytest.raises(openai.APIStatusError) as e:
            big = [{"role": "user", "content": "x" * (10 << 20)}]
            await client.chat.completions.create(model=MODEL, messages=big)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

    async def chunks():  # no Content-Length: cut while reading
        for _ in range(10):
            yield b"x" * (1 << 20)

    async with httpx.AsyncClient(trust_env=False) as http:
        r = await http.post(f"http://127.0.0.1:{gw.port}{CHAT}", content=chunks(), headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert gw.sessions.requests == []


@pytest.mark.parametrize(("retry_after", "header"), [(2.5, "3"), (0.01, "1"), (float("inf"), "1")])
async def test_busy_is_429_with_retry_after(gw, retry_after, header):
    gw.sessions.error = Busy("64 requests in flight", retry_after=retry_after)
    async with gw.http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
        assert r.status == 429 and r.headers["Retry-After"] == header
        assert (await error_of(r))["type"] == "rate_limit_error"


@pytest.mark.parametrize("error", [RuntimeError, ConnectionRefusedError])
async def test_a_crash_in_the_sessions_is_500_logged_and_the_server_goes_on(gw, caplog, error):
    gw.sessions.error = error("secret internals")
    with caplog.at_level(logging.ERROR, logger="relayrl.gateway.http"):
        async with gw.http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
            assert r.status == 500
            err = await error_of(r)
    assert "secret" not in err["message"] and err["type"] == "server_error"
    (record,) = [r for r in caplog.records if r.name == "relayrl.gateway.http"]
    assert record.exc_info and isinstance(record.exc_info[1], error)
    async with gw.http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
        assert r.status == 200


async def test_gateway_errors_of_the_sessions_keep_their_status(gw):
    gw.sessions.error = BadRequest("the dialogue does not extend the session's", param="messages")
    async with gw.http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
        assert r.status == 400 and (await error_of(r))["param"] == "messages"


async def test_a_slow_answer_past_the_request_timeout_is_504():
    async with serving(request_timeout_seconds=0.05) as s:
        s.sessions.gate = asyncio.Event()  # never set: the generator never answers
        async with s.http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
            assert r.status == 504 and (await error_of(r))["code"] == "timeout"


async def test_unknown_routes_and_methods_get_openai_errors(gw):
    async with gw.http.post("/v1/completions", json={}, headers=auth()) as r:
        assert r.status == 404 and (await error_of(r))["code"] == "not_found"
    async with gw.http.get(CHAT, headers=auth()) as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]
        assert (await error_of(r))["code"] == "method_not_allowed"
    assert ("unmatched", 404) in gw.metrics.seen and ("unmatched", 405) in gw.metrics.seen


# -- clients that leave --------------------------------------------------------------------------


async def test_a_client_that_leaves_mid_stream_leaves_the_server_serving(gw, caplog):
    # An answer far larger than the socket buffers can hold: the server is still writing it when
    # the client resets the connection.
    gw.sessions.answer = Answer(c.ChatMessage(role="assistant", content="y" * (8 << 20)), "length", 1, 1)
    body = json.dumps({"model": MODEL, "messages": USER, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gw.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"data: ")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    writer.close()
    with caplog.at_level(logging.ERROR):
        assert await gw.metrics.next_for(CHAT) == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_client_that_leaves_while_the_model_answers_leaves_the_server_serving(gw):
    gw.sessions.gate = asyncio.Event()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    body = json.dumps({"model": MODEL, "messages": USER}).encode()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await gw.sessions.entered.wait()
    writer.close()
    await writer.wait_closed()
    gw.sessions.gate.set()  # the turn ends after its client is gone: finished, not cancelled
    assert await gw.metrics.next_for(CHAT) == 499  # its answer had nobody to go to
    assert len(gw.sessions.requests) == 1


async def test_a_body_that_never_arrives_is_408_within_the_body_timeout():
    async with serving(body_timeout_seconds=0.2) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            'Content-Length: 1000\r\n\r\n{"model": '.encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)  # answered, not held open
        assert head.startswith(b"HTTP/1.1 408"), head
        assert await s.metrics.next_for(CHAT) == 408
        writer.close()
        await writer.wait_closed()


async def test_a_client_that_leaves_mid_body_leaves_the_server_serving(gw):
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        'Content-Length: 1000\r\n\r\n{"model": '.encode()
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    assert await gw.metrics.next_for(CHAT) == 499
    assert gw.sessions.requests == []


# -- rewards, metrics, a Unix socket -------------------------------------------------------------


async def test_set_reward(gw):
    ok = {"reward": 1.5, "components": {"tests": 1.0, "style": 0.5}}
    async with gw.http.post("/rl/set_reward", json=ok, headers=auth()) as r:
        assert r.status == 200 and await r.json() == {"ok": True}
    assert gw.sessions.rewards == [RewardSet(1.5, {"tests": 1.0, "style": 0.5})]
    bad = [
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": true}',
        b'{"reward": "1"}',
        b"{}",
        json.dumps({"reward": 1, "components": {f"c{i}": 1 for i in range(33)}}).encode(),
        json.dumps({"reward": 1, "components": {"n" * 65: 1}}).encode(),
        json.dumps({"reward": 1, "components": {"x": None}}).encode(),
    ]
    for body in bad:
        async with gw.http.post("/rl/set_reward", data=body, headers=auth()) as r:
            assert r.status == 400, body
    async with gw.http.post("/rl/set_reward", json=ok, headers=auth("rrl-other")) as r:
        assert r.status == 401
    assert len(gw.sessions.rewards) == 1


async def test_prometheus_counts_requests_by_route_and_status():
    def count(route: str, status: str) -> float:
        labels = {"route": route, "status": status}
        return REGISTRY.get_sample_value("relayrl_gateway_http_requests_total", labels) or 0.0

    before = count(CHAT, "200"), count(CHAT, "401")
    async with serving(metrics=GatewayMetrics()) as s:
        async with s.http.post(CHAT, json={"model": MODEL, "messages": USER}, headers=auth()) as r:
            assert r.status == 200
        async with s.http.post(CHAT, json={"model": MODEL, "messages": USER}) as r:
            assert r.status == 401
    # The serving() exit check made one more 200.
    assert (count(CHAT, "200") - before[0], count(CHAT, "401") - before[1]) == (2, 1)
    assert REGISTRY.get_sample_value("relayrl_gateway_http_seconds_count", {"route": CHAT}) >= 2


async def test_serves_a_unix_socket_too(tmp_path):
    path = str(tmp_path / "gw.sock")
    async with serving(unix_path=path):
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http,
            http.get("http://gateway/v1/models", headers=auth()) as r,
        ):
            assert (await r.json())["data"][0]["id"] == MODEL


# -- reading requests (pure) ---------------------------------------------------------------------


def test_parse_reads_what_agents_send_and_ignores_the_rest():
    tools = [{"function": {"name": "calc", "parameters": {}}, "type": "function"}]  # key order kept
    req = parse_chat_request(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [], "refusal": None},
            ],
            "tools": tools,
            "max_tokens": 100,
            "max_completion_tokens": 50,
            "stream": True,
            "stream_options": {"include_usage": False},
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "some_future_field": {"x": 1},
        }
    )
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "sys"),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert req.tools_json == '[{"function": {"name": "calc", "parameters": {}}, "type": "function"}]'
    assert (req.max_tokens, req.stream, req.model) == (50, True, MODEL)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "function", "content": "x"}, "messages[0].role"),
        ({"role": ["user"], "content": "x"}, "messages[0].role"),
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "messages[0].content[0]"),
        ({"role": "user", "content": "x" * 4_000_001}, "messages[0].content"),
        ({"role": "tool", "content": "4"}, "messages[0].tool_call_id"),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f", "arguments": "{}"}}]},
            "messages[0].tool_calls[0].id",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "a", "function": {"name": "f" * 129, "arguments": "{}"}}],
            },
            "messages[0].tool_calls[0].function.name",
        ),
    ],
)
def test_parse_names_the_bad_field(message, param):
    with pytest.raises(BadRequest) as e:
        parse_chat_request({"model": MODEL, "messages": [message]})
    assert e.value.param == param and e.value.status == 400


def test_an_echoed_call_that_did_not_parse_is_taken_back_with_its_status():
    from relayrl.common.v1 import common_pb2 as c
    from relayrl.gateway import openai_api

    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "", "arguments": "<tool ="},
         "relayrl_parse_error": "unclosed_block"}]}  # fmt: skip
    req = openai_api.parse_chat_request({"model": MODEL, "messages": [*USER, echoed]})
    call = req.messages[1].tool_calls[0]
    assert (call.name, call.arguments_json, call.parse) == ("", "<tool =", c.TOOL_CALL_PARSE_UNCLOSED_BLOCK)
    with pytest.raises(openai_api.BadRequest, match="relayrl_parse_error"):
        bad = {**echoed, "tool_calls": [{**echoed["tool_calls"][0], "relayrl_parse_error": "made_up"}]}
        openai_api.parse_chat_request({"model": MODEL, "messages": [*USER, bad]})
    with pytest.raises(openai_api.BadRequest, match="JSON object"):  # without it: a call as any other
        plain = {
            **echoed,
            "tool_calls": [{k: v for k, v in echoed["tool_calls"][0].items() if k != "relayrl_parse_error"}],
        }
        openai_api.parse_chat_request({"model": MODEL, "messages": [*USER, plain]})
