"""The gateway's HTTP server (aiohttp): OpenAI's ``/v1/chat/completions`` and ``/v1/models`` for
black-box agents, and ``/rl/set_reward``, in front of the sessions (``api.Sessions``).

A request flows: Bearer key (401) -> body bounded to ``max_body_bytes`` (413) and read within
``body_timeout_s`` (408) -> JSON (400) ->
``openai_api.parse_chat_request`` (400) -> model name (404) -> ``sessions.complete`` under
``request_timeout_s`` (504) -> a JSON completion, or with ``stream`` an SSE framing of the whole
answer. Every refusal is an OpenAI error body with the ``GatewayError``'s status (429 with
``Retry-After``); any other exception is logged with its traceback and answered 500, and the
server goes on serving. A client that leaves mid-answer does not cancel ``complete`` (aiohttp's
default): the turn is finished and recorded; writing to the gone client just stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from relayrl.gateway import openai_api
from relayrl.gateway.api import (
    BadRequest,
    Busy,
    GatewayError,
    NotFound,
    Sessions,
    TooLarge,
    Unauthorized,
    UpstreamTimeout,
)

log = logging.getLogger(__name__)

CLIENT_LEFT = 499
"""The status metrics record for a request whose client left before its answer was written."""
MAX_RETRY_AFTER_S = 3600


class HttpMetrics(Protocol):
    """Where answered requests are counted (``metrics.GatewayMetrics``)."""

    def observe_http(self, route: str, status: int, seconds: float) -> None: ...


class MethodNotAllowed(GatewayError):
    status, code, kind = 405, "method_not_allowed", "invalid_request_error"


class SlowBody(GatewayError):
    status, code, kind = 408, "request_timeout", "invalid_request_error"


class _EventStream(web.StreamResponse):
    """An SSE answer; ``client_left`` once writing to the client failed."""

    client_left = False


def _bearer_key(request: web.Request) -> str:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("no API key: send 'Authorization: Bearer <session key>'")
    return key.strip()


async def _json_body(request: web.Request, timeout_s: float) -> object:
    limit = request.client_max_size
    # Refuse a declared oversize body before reading any of it; a chunked one is cut by read().
    # aiohttp then reads and drops the rest (for up to 10 s) before it closes, so a client that
    # sends its whole body before reading (httpx, urllib) still gets the 413.
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"request body is larger than {limit} bytes")
    try:
        async with asyncio.timeout(timeout_s):  # a client that trickles its body holds no handler
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"request body is larger than {limit} bytes") from None
    except TimeoutError:
        raise SlowBody(f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: deeply nested arrays
        raise BadRequest("request body is not valid JSON") from None


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


def _middleware(metrics: HttpMetrics | None):
    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.monotonic()
        status = 500
        try:
            resp = await handler(request)
            status = CLIENT_LEFT if getattr(resp, "client_left", False) else resp.status
            return resp
        except GatewayError as err:
            status = err.status
            return _error_response(err)
        except web.HTTPException as exc:
            err = _from_http_exception(exc, request)
            status = err.status
            allow = exc.headers.get("Allow")
            return _error_response(err, {"Allow": allow} if allow else None)
        except Exception as exc:
            transport = request.transport
            if isinstance(exc, ConnectionError) and (transport is None or transport.is_closing()):
                # The client's own connection broke (mid-body): nothing to answer, nothing wrong.
                status = CLIENT_LEFT
                log.info("client left %s %s before its answer", request.method, request.path)
                return web.Response(status=CLIENT_LEFT)  # nobody reads it
            log.exception("unexpected error answering %s %s", request.method, request.path)
            return _error_response(GatewayError("internal error in the gateway (see its log)"))
        finally:
            if metrics is not None:
                metrics.observe_http(_route_of(request), status, time.monotonic() - start)

    return answer


class _Routes:
    def __init__(self, sessions: Sessions, request_timeout_s: float, body_timeout_s: float):
        self.sessions = sessions
        self.request_timeout_s = request_timeout_s
        self.body_timeout_s = body_timeout_s

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        key = _bearer_key(request)
        self.sessions.check_key(key)
        body = await _json_body(request, self.body_timeout_s)
        req = openai_api.parse_chat_request(body)
        if req.model != self.sessions.model:
            raise NotFound(
                f"model {req.model!r} does not exist: this gateway serves {self.sessions.model!r}",
                param="model",
            )
        timeout = None
        try:
            async with asyncio.timeout(self.request_timeout_s) as timeout:
                answer = await self.sessions.complete(key, req)
        except TimeoutError:
            if timeout is None or not timeout.expired():
                raise  # raised inside complete, not our deadline: a 500
            raise UpstreamTimeout(f"no answer within {self.request_timeout_s:g} s") from None
        if not req.stream:
            return web.json_response(openai_api.completion_json(answer, self.sessions.model))
        chunks = openai_api.stream_chunks(answer, self.sessions.model, openai_api.include_usage(body))
        return await _send_stream(request, chunks)

    async def models(self, request: web.Request) -> web.Response:
        self.sessions.check_key(_bearer_key(request))
        model = {"id": self.sessions.model, "object": "model", "created": 0, "owned_by": "relayrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def set_reward(self, request: web.Request) -> web.Response:
        key = _bearer_key(request)
        self.sessions.check_key(key)
        reward = openai_api.parse_reward_set(await _json_body(request, self.body_timeout_s))
        self.sessions.set_reward(key, reward, by_agent=True)
        return web.json_response({"ok": True})


async def _send_stream(request: web.Request, chunks: list[dict]) -> _EventStream:
    resp = _EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:  # the client left mid-stream: its turn is recorded all the same
        resp.client_left = True
        log.info("client left during a streamed answer")
    return resp


def make_app(
    sessions: Sessions,
    *,
    max_body_bytes: int,
    request_timeout_s: float,
    body_timeout_s: float = 30.0,
    metrics: HttpMetrics | None = None,
) -> web.Application:
    """The gateway's aiohttp application over ``sessions``; ``metrics`` counts each request.
    A body must arrive within ``body_timeout_s`` (408), an answer within ``request_timeout_s``
    (504)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_middleware(metrics)])
    routes = _Routes(sessions, request_timeout_s, body_timeout_s)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/rl/set_reward", routes.set_reward)
    return app


async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    unix_path: str | None = None,
    *,
    tls: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: a free port), over HTTPS with ``tls``, and with
    ``unix_path`` on that Unix socket too. Returns the runner (``await runner.cleanup()`` stops
    it) and the TCP port bound."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
        bound = runner.addresses[0][1]
        if unix_path is not None:
            await web.UnixSite(runner, unix_path, ssl_context=tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, bound
