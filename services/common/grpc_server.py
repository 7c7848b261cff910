"""gRPC server bootstrap shared by every service.

``create_server`` builds a ``grpc.aio`` server with the service's servicer, ``grpc.health.v1``
and reflection (``grpc.reflection.v1`` and ``v1alpha``, ``relayrl.common.reflection``), and binds
it (port 0 picks a free port, which tests rely on). Who may call comes from the same
``ServeConfig`` (``relayrl.common.security``): TLS when a certificate is given, a bearer-token
interceptor when a token file is, and a refusal to bind off loopback without TLS unless
``insecure``; health and reflection answer without a token. ``serve_forever``
runs it until SIGTERM/SIGINT, then shuts down in the order production needs: health goes
NOT_SERVING (load balancers stop sending work), in-flight RPCs get ``grace`` seconds, then the
engine is shut down.

Health semantics: the empty service name means *live* (the process answers); the service's
full name means *ready* (the engine is loaded and not mid weight swap). Kubernetes liveness
probes the first, readiness the second.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayrl.common.logcontext import ContextInterceptor
from relayrl.common.reflection import enable_reflection
from relayrl.common.rpc import decoder
from relayrl.common.security import server_security
from relayrl.common.serving import ServeConfig

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class ServerHandle:
    """A bound, not yet started server and what its shutdown needs."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_name: str
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    linger: float = 0.0
    """Seconds it goes on serving after a first SIGTERM (``ServeConfig.term_linger_seconds``)."""

    async def set_ready(self, ready: bool) -> None:
        """Readiness of the named service (liveness stays SERVING until shutdown)."""
        await self.health.set(self.service_name, SERVING if ready else NOT_SERVING)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING everywhere, drain for ``grace`` seconds, then run the shutdown hooks."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for hook in self.on_shutdown:
            try:
                await hook()
            except Exception:
                logger.exception("shutdown hook failed")


def add_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Register ``servicer`` for ``service`` as the generated ``add_*_to_server`` does, except that
    requests decode with ``rpc.decoder``: bytes that are not the message reach the servicer's
    ``map_errors`` and come back INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""
    from google.protobuf.message_factory import GetMessageClass

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {
        m.name: kinds[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name),
            request_deserializer=decoder(GetMessageClass(m.input_type)),
            response_serializer=GetMessageClass(m.output_type).SerializeToString,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def create_server(
    servicer: object,
    service: ServiceDescriptor,
    serve: ServeConfig | None = None,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
) -> ServerHandle:
    """Build and bind a server for ``servicer`` of ``service`` as ``serve`` says (default:
    loopback, a free port, no TLS). Returns before starting.

    Raises ``SecurityError`` (nothing bound) when the access settings are unusable: a bind off
    loopback without TLS and not ``insecure``, an unreadable certificate or token file.
    """
    serve = serve or ServeConfig()
    credentials, auth = server_security(serve)
    limit = serve.max_message_mb * 1024 * 1024
    server = grpc.aio.server(
        # The token check first: a stranger reaches no servicer. Then the caller's run id, step
        # and policy version go into this service's log lines.
        interceptors=[*auth, ContextInterceptor(), *interceptors],
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ],
    )
    add_service(server, servicer, service)
    service_full_name = service.full_name
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (service_full_name, health.SERVICE_NAME))
    host = serve.host
    address = f"[{host}]:{serve.port}" if ":" in host else f"{host}:{serve.port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return ServerHandle(
        server=server,
        port=bound,
        health=health_servicer,
        service_name=service_full_name,
        linger=serve.term_linger_seconds,
    )


async def start(handle: ServerHandle, ready: bool) -> None:
    """Start serving: live at once, ready as given (a loading engine starts not ready)."""
    await handle.server.start()
    await handle.health.set("", SERVING)
    await handle.set_ready(ready)


async def serve_forever(
    handle: ServerHandle, grace: float, fatal: Awaitable[str] | None = None
) -> str | None:
    """Block until SIGTERM/SIGINT or termination, then stop gracefully (see module doc).
    ``fatal`` ends with a reason when the engine behind the service died for good: the server
    stops the same way and the reason is returned, for the process to exit with status 1 so
    that its supervisor (Kubernetes, compose, Ray) restarts it; a live process around a dead
    engine would only ever answer errors, with a liveness probe saying SERVING."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    waiter = asyncio.ensure_future(handle.server.wait_for_termination())
    signalled = asyncio.ensure_future(stop.wait())
    died = asyncio.ensure_future(fatal if fatal is not None else asyncio.Event().wait())
    # wait: the server's lifetime: SIGTERM/SIGINT, the server's termination or ``fatal`` ends it
    await asyncio.wait({waiter, signalled, died}, return_when=asyncio.FIRST_COMPLETED)
    requested = signalled.done()
    if requested and handle.linger > 0 and not (waiter.done() or died.done()):
        logger.info(
            "signalled: serving %.0fs more (serve.term_linger_seconds; again to stop now)", handle.linger
        )
        stop.clear()
        again = asyncio.ensure_future(stop.wait())
        # wait: at most the linger; a second signal, the server's end or the engine's cut it short
        await asyncio.wait({waiter, again, died}, timeout=handle.linger, return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
    reason = None
    if died.done() and not died.cancelled():
        failed = died.exception()  # always read, so asyncio has nothing left to report
        reason = f"the engine monitor failed: {failed!r}" if failed is not None else died.result()
    if requested:  # a requested stop wins: a SIGTERM to the group also ends an engine's processes
        reason = None
    if reason:
        logger.error("%s; shutting down to be restarted", reason)
    logger.info("shutting down (grace %.1fs)", grace)
    await handle.stop(grace)
    for task in (waiter, signalled, died):
        task.cancel()
    return reason


async def announce_and_serve(
    handle: ServerHandle,
    name: str,
    host: str,
    grace: float,
    port_file: str | None,
    fatal: Awaitable[str] | None = None,
) -> str | None:
    """Mark ready, tell the world where we are (port file for launchers, a line for people),
    then serve until SIGTERM (or ``fatal``, see ``serve_forever``)."""
    if port_file:
        with open(port_file, "w") as f:
            f.write(f"{handle.port}\n")
    print(f"relayrl {name} ready on {host}:{handle.port}", flush=True)
    await handle.set_ready(True)
    return await serve_forever(handle, grace, fatal)


def start_metrics_server(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Serve Prometheus metrics of this process on ``host:port``; returns the bound port."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return server.server_port
