"""Build and run a gateway replica: the sessions (``core.py``), the gRPC control API with health
and reflection, the OpenAI-compatible HTTP API, and metrics."""

from __future__ import annotations

import asyncio
import logging

from relayrl.common.grpc_server import (
    ServerHandle,
    announce_and_serve,
    create_server,
    start,
    start_metrics_server,
)
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.core import GatewayCore
from relayrl.gateway.http import make_app, serve_http
from relayrl.gateway.metrics import GatewayMetrics
from relayrl.gateway.servicer import GatewayServicer
from relayrl.gateway.upstream import Generators
from relayrl.gateway.v1 import gateway_pb2

logger = logging.getLogger(__name__)
DESCRIPTOR = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]


def base_url(config: GatewayConfig, port: int) -> str:
    """What agents are pointed at: ``http.public_url``, else the bound port at ``public_host``
    (or the bound host).

    >>> base_url(GatewayConfig(), 8000)
    'http://127.0.0.1:8000/v1'
    >>> base_url(GatewayConfig(http={"host": "::", "public_host": "fd00::7", "insecure": True}), 41234)
    'http://[fd00::7]:41234/v1'
    """
    if config.http.public_url:
        return config.http.public_url.rstrip("/")
    scheme = "https" if config.http.tls_cert else "http"
    named = config.http.public_host or config.http.host
    host = f"[{named}]" if ":" in named else named
    return f"{scheme}://{host}:{port}/v1"


async def build(config: GatewayConfig) -> tuple[ServerHandle, GatewayCore]:
    """The gRPC server (bound, not started) and the HTTP API (serving) around one core; call
    from inside the event loop that will serve. Shutting the gRPC server down stops the rest."""
    metrics = GatewayMetrics()
    generators = Generators(
        config.generators, config.client, config.generate_deadline_seconds, config.retry_after_seconds
    )
    core = GatewayCore(config, generators, metrics)
    handle = create_server(GatewayServicer(core), DESCRIPTOR, config.serve)
    app = make_app(core, config.http, metrics=metrics, retry_after_s=config.retry_after_seconds)
    runner, port = await serve_http(app, config.http.host, config.http.port, tls=tls_context(config))
    core.base_url, core.http_port = base_url(config, port), port
    sweeper = asyncio.ensure_future(core.sweep_forever())

    async def stop_rest() -> None:
        sweeper.cancel()
        await runner.cleanup()
        await generators.close()

    handle.on_shutdown.append(stop_rest)
    return handle, core


def tls_context(config: GatewayConfig):
    """The HTTPS context of ``http.tls_cert``/``tls_key``, or None (plain HTTP on loopback)."""
    if not config.http.tls_cert:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.http.tls_cert, config.http.tls_key)
    return ctx


async def run(config: GatewayConfig, port_file: str | None = None) -> None:
    """Serve until SIGTERM."""
    handle, core = await build(config)
    await start(handle, ready=False)
    metrics_port = start_metrics_server(config.serve.metrics_port, config.serve.host)
    logger.info(
        "gateway: OpenAI API at %s, %d generators, gRPC on %s:%d (metrics port %s)",
        core.base_url,
        len(config.generators),
        config.serve.host,
        handle.port,
        metrics_port,
    )
    await announce_and_serve(handle, "gateway", config.serve.host, config.serve.grace_seconds, port_file)
