"""The gateway's HTTP server (aiohttp): OpenAI's ``/v1/chat/completions``, ``/v1/responses`` and
``/v1/models`` for black-box agents, and ``/rl/set_reward``, in front of the sessions
(``api.Sessions``). Both model APIs read their bodies into one ``ChatRequest`` (``openai_api``,
``responses_api``) and answer from one ``Answer``: one way to sample and record a turn.

Below the routes, ``connections.py`` bounds the connections (per peer, in all, the time to send
a request head). A request flows: Bearer key (401) -> ``Expect`` other than 100-continue (417) ->
declared body over ``max_body_mb`` (413) -> the key's, then the peer's, requests with unfinished
bodies (``max_unfinished_per_key``/``_per_peer``: 429) -> "100 Continue" when the client waits
for it -> body bounded (413) and read within ``body_timeout_seconds`` (408) -> UTF-8 JSON without
lone surrogates (400) -> ``openai_api.parse_chat_request`` or
``responses_api.parse_responses_request`` (400), both off the event loop for a large body ->
model name (404) -> ``sessions.complete`` under ``request_timeout_seconds`` (504) -> a JSON
completion or response, or with ``stream`` an SSE framing of the whole answer. So a request is
refused before its body is sent or read whenever its head says enough, and nothing of a request
that does not decode reaches its session. Every refusal is an OpenAI error body with the
``GatewayError``'s status (429 with ``Retry-After``); any other exception is logged with its
traceback and answered 500, and the server goes on serving. A client that leaves mid-answer does
not cancel ``complete`` (aiohttp's default): the turn is finished and recorded; writing to the
gone client just stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from aiohttp import web
from relayrl.gateway import openai_api, responses_api
from relayrl.gateway.api import (
    Answer,
    BadRequest,
    Busy,
    ChatRequest,
    GatewayError,
    NotFound,
    Sessions,
    TooLarge,
    Unauthorized,
    UpstreamTimeout,
)
from relayrl.gateway.config import HttpConfig
from relayrl.gateway.connections import Bounds, Connections, GuardedSite

log = logging.getLogger(__name__)

CLIENT_LEFT = 499
"""The status metrics record for a request whose client left before its answer was written."""
MAX_RETRY_AFTER_S = 3600
OFF_LOOP_BYTES = 256 << 10
"""Bodies from this size on are decoded and parsed in a thread: JSON and the history keys take
time linear in a body, which at a few MiB is long enough to hold up every other request."""
CONNECTIONS = web.AppKey("gateway_connections", Connections)
T = TypeVar("T")


class HttpMetrics(Protocol):
    """Where answered requests are counted (``metrics.GatewayMetrics``)."""

    def observe_http(self, route: str, status: int, seconds: float) -> None: ...

    def refused(self, reason: str) -> None:
        """A connection or request refused below the routes (``connections.ConnectionMetrics``)."""


class MethodNotAllowed(GatewayError):
    status, code, kind = 405, "method_not_allowed", "invalid_request_error"


class SlowBody(GatewayError):
    status, code, kind = 408, "request_timeout", "invalid_request_error"


class ExpectationFailed(GatewayError):
    status, code, kind = 417, "expectation_failed", "invalid_request_error"


class _EventStream(web.StreamResponse):
    """An SSE answer; ``client_left`` once writing to the client failed."""

    client_left = False


class _ClientLeft(web.Response):
    """What a request whose client left gets: nobody reads it; metrics count it as 499."""

    client_left = True

    def __init__(self):
        super().__init__(status=CLIENT_LEFT)


def _bearer_key(request: web.Request) -> str:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("no API key: send 'Authorization: Bearer <session key>'")
    return key.strip()


def _expects_continue(request: web.Request) -> bool:
    """Whether the client waits for "100 Continue" before it sends its body. RFC 9110 10.1.1:
    another expectation may be refused (417); an HTTP/1.0 client's is ignored."""
    expect = request.headers.get("Expect")
    if expect is None or request.version < (1, 1):
        return False
    if expect.strip().lower() != "100-continue":
        raise ExpectationFailed("the only expectation this server meets is 'Expect: 100-continue'")
    return True


async def _no_continue(request: web.Request) -> None:
    """The routes' ``expect_handler``: aiohttp's own sends "100 Continue" before any handler runs,
    so a client with no key, or over its bounds, would send its body all the same. The routes
    send it themselves, once the request may go on (``_Routes.body``)."""


def _retry_after_s(seconds: float) -> int:
    if not math.isfinite(seconds):
        return 1
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds)))


def _error_response(err: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    resp = web.json_response(openai_api.error_json(err), status=err.status, headers=headers)
    if isinstance(err, Busy):
        resp.headers["Retry-After"] = str(_retry_after_s(err.retry_after))
    return resp


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> GatewayError:
    """aiohttp's own refusals (no route, wrong method, body too large) as OpenAI errors."""
    where = f"{request.method} {request.path}"[:200]
    if exc.status == 404:
        return NotFound(f"no such route: {where}", code="not_found")
    if exc.status == 405:
        return MethodNotAllowed(f"method not allowed: {where}")
    if exc.status == 413:
        return TooLarge(f"request body is larger than {request.client_max_size} bytes")
    err = GatewayError(exc.reason or "error", code="http_error")
    err.status = exc.status
    err.kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return err


def _route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _middleware(conns: Connections, metrics: HttpMetrics | None):
    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.monotonic()
        status = 500
        conns.begin(request.protocol)  # a request head arrived: no head deadline while it is served
        try:
            resp = await _answer(request, handler)
            status = CLIENT_LEFT if getattr(resp, "client_left", False) else resp.status
            unread = request.body_exists and not request.content.is_eof()
            if unread:  # refused before its body was read: no next request on this connection
                resp.force_close()  # RFC 9110 10.1.1: say so ("Connection: close")
            # Written here, not after the middleware returns: the connection waits for its next
            # head (and may be evicted) only once its answer is handed to the transport.
            await resp.prepare(request)
            await resp.write_eof()
            if unread and not request.content.total_bytes and "Expect" in request.headers:
                # A client that waits for "100 Continue" (or got it and sent nothing) sends no
                # body to read and drop, which aiohttp would wait for up to its lingering time.
                request.protocol.force_close()
            return resp
        except ConnectionError:
            status = CLIENT_LEFT
            return _ClientLeft()
        finally:
            conns.end(request.protocol)
            if metrics is not None:
                metrics.observe_http(_route_of(request), status, time.monotonic() - start)

    return answer


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        allow = exc.headers.get("Allow")
        return _error_response(_from_http_exception(exc, request), {"Allow": allow} if allow else None)
    except Exception as exc:
        transport = request.transport
        if isinstance(exc, ConnectionError) and (transport is None or transport.is_closing()):
            # The client's own connection broke (mid-body): nothing to answer, nothing wrong.
            log.info("client left %s %s before its answer", request.method, request.path)
            return _ClientLeft()
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return _error_response(GatewayError("internal error in the gateway (see its log)"))


class _Unfinished:
    """Requests whose bodies are arriving or being decoded, counted by session key and by peer;
    past a bound, 429 before the body is read. An agent's body arrives in milliseconds: a key or
    a peer with many at once is holding memory, not sending dialogue."""

    def __init__(self, per_key: int, per_peer: int, retry_after_s: float):
        self.per_key, self.per_peer, self.retry_after_s = per_key, per_peer, retry_after_s
        self.keys: Counter[str] = Counter()
        self.peers: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, key: str, peer: str):
        if self.keys[key] >= self.per_key:
            raise Busy(
                f"this session key has {self.keys[key]} request bodies arriving "
                "(gateway http.max_unfinished_per_key)",
                self.retry_after_s,
            )
        if self.peers[peer] >= self.per_peer:
            raise Busy(
                f"this address has {self.peers[peer]} request bodies arriving "
                "(gateway http.max_unfinished_per_peer)",
                self.retry_after_s,
            )
        self.keys[key] += 1
        self.peers[peer] += 1
        try:
            yield
        finally:
            for counts, k in ((self.keys, key), (self.peers, peer)):
                counts[k] -= 1
                if not counts[k]:
                    del counts[k]


class _Routes:
    def __init__(
        self,
        sessions: Sessions,
        http: HttpConfig,
        conns: Connections,
        unfinished: _Unfinished,
        decoder: ThreadPoolExecutor,
    ):
        self.sessions, self.http, self.conns = sessions, http, conns
        self.unfinished, self.decoder = unfinished, decoder

    async def body(self, request: web.Request, key: str, parse: Callable[[object], T]) -> tuple[object, T]:
        """The decoded body of an authorized request and ``parse`` of it. Refused (417, 413, 429)
        before any of it is read; "100 Continue", when the client waits for it, only past those.
        The request counts as unfinished until its body is parsed."""
        expects = _expects_continue(request)
        limit = request.client_max_size
        # Refuse a declared oversize body before reading any of it; a chunked one is cut by read().
        # aiohttp then reads and drops the rest (for up to 10 s) before it closes, so a client
        # that sends its whole body before reading (httpx, urllib) still gets the 413.
        if request.content_length is not None and request.content_length > limit:
            raise TooLarge(f"request body is larger than {limit} bytes")
        with self.unfinished.hold(key, request.remote or ""):
            if expects:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # as aiohttp's own: the answer has not started
            return await self._decode(await self._read(request), parse)

    async def _read(self, request: web.Request) -> bytes:
        limit, timeout_s = request.client_max_size, self.http.body_timeout_seconds
        try:
            async with asyncio.timeout(timeout_s):  # a client that trickles its body holds no handler
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise TooLarge(f"request body is larger than {limit} bytes") from None
        except TimeoutError:
            raise SlowBody(f"the request body did not arrive within {timeout_s:g} s") from None
        except web.RequestPayloadError as e:  # a chunked body that breaks its framing
            self.conns.malformed(request.remote or "", e)
            raise BadRequest("request body is malformed (its framing)") from None

    async def _decode(self, raw: bytes, parse: Callable[[object], T]) -> tuple[object, T]:
        def decode() -> tuple[object, T]:
            body = openai_api.decode_json(raw)
            return body, parse(body)

        if len(raw) < OFF_LOOP_BYTES:
            return decode()
        return await asyncio.get_running_loop().run_in_executor(self.decoder, decode)

    async def _complete(
        self, request: web.Request, parse: Callable[[object], ChatRequest]
    ) -> tuple[object, ChatRequest, Answer]:
        """``(body, request, answer)`` of a model API request: read, checked, sampled."""
        key = _bearer_key(request)
        self.sessions.check_key(key)
        body, req = await self.body(request, key, parse)
        if req.model != self.sessions.model:
            raise NotFound(
                f"model {req.model!r} does not exist: this gateway serves {self.sessions.model!r}",
                param="model",
            )
        timeout = None
        limit_s = self.http.request_timeout_seconds
        try:
            async with asyncio.timeout(limit_s) as timeout:
                answer = await self.sessions.complete(key, req)
        except TimeoutError:
            if timeout is None or not timeout.expired():
                raise  # raised inside complete, not our deadline: a 500
            raise UpstreamTimeout(f"no answer within {limit_s:g} s") from None
        return body, req, answer

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, req, answer = await self._complete(request, openai_api.parse_chat_request)
        if not req.stream:
            return web.json_response(openai_api.completion_json(answer, self.sessions.model))
        chunks = openai_api.stream_chunks(answer, self.sessions.model, openai_api.include_usage(body))
        frames = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks]
        return await _send_stream(request, [*frames, b"data: [DONE]\n\n"])

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body, req, answer = await self._complete(request, responses_api.parse_responses_request)
        if not req.stream:
            return web.json_response(responses_api.response_json(answer, body, self.sessions.model))
        events = responses_api.stream_events(answer, body, self.sessions.model)
        return await _send_stream(request, responses_api.event_frames(events))

    async def models(self, request: web.Request) -> web.Response:
        self.sessions.check_key(_bearer_key(request))
        model = {"id": self.sessions.model, "object": "model", "created": 0, "owned_by": "relayrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def set_reward(self, request: web.Request) -> web.Response:
        key = _bearer_key(request)
        self.sessions.check_key(key)
        _, reward = await self.body(request, key, openai_api.parse_reward_set)
        self.sessions.set_reward(key, reward, by_agent=True)
        return web.json_response({"ok": True})


async def _send_stream(request: web.Request, frames: list[bytes]) -> _EventStream:
    """Server-sent event ``frames``, each written as it is."""
    resp = _EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        for frame in frames:
            await resp.write(frame)
        await resp.write_eof()
    except ConnectionError:  # the client left mid-stream: its turn is recorded all the same
        resp.client_left = True
        log.info("client left during a streamed answer")
    return resp


def make_app(
    sessions: Sessions,
    http: HttpConfig,
    *,
    metrics: HttpMetrics | None = None,
    retry_after_s: float = 1.0,
) -> web.Application:
    """The gateway's aiohttp application over ``sessions``, bounded as ``http`` says (``serve_http``
    serves it with its connection bounds); ``metrics`` counts each request, ``retry_after_s`` is
    what a 429 for too many unfinished bodies tells the client to wait."""
    bounds = Bounds(http.header_timeout_seconds, http.max_connections, http.max_connections_per_peer)
    conns = Connections(bounds, metrics)
    unfinished = _Unfinished(http.max_unfinished_per_key, http.max_unfinished_per_peer, retry_after_s)
    # One thread: large bodies are decoded one after the other, not all at once against the
    # event loop for the interpreter lock.
    decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-decode")
    app = web.Application(
        client_max_size=int(http.max_body_mb * (1 << 20)), middlewares=[_middleware(conns, metrics)]
    )
    app[CONNECTIONS] = conns
    routes = _Routes(sessions, http, conns, unfinished, decoder)
    app.router.add_post("/v1/chat/completions", routes.chat_completions, expect_handler=_no_continue)
    app.router.add_post("/v1/responses", routes.responses, expect_handler=_no_continue)
    app.router.add_get("/v1/models", routes.models, expect_handler=_no_continue)
    app.router.add_post("/rl/set_reward", routes.set_reward, expect_handler=_no_continue)

    async def stop_decoder(app: web.Application) -> None:
        decoder.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_decoder)
    return app


async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    unix_path: str | None = None,
    *,
    tls: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` (from ``make_app``) on ``host:port`` (0: a free port), over HTTPS with
    ``tls``, and with ``unix_path`` on that Unix socket too, its connections bounded
    (``connections.py``). Returns the runner (``await runner.cleanup()`` stops it) and the TCP
    port bound."""
    conns = app[CONNECTIONS]
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await GuardedSite(runner, conns, host=host, port=port, ssl_context=tls).start()
        bound = runner.addresses[0][1]
        if unix_path is not None:
            await GuardedSite(runner, conns, path=unix_path, ssl_context=tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, bound
