"""Build and run a generator replica: vLLM engine + GeneratorService + health + metrics."""

from __future__ import annotations

import logging
import socket

from relayrl.common.grpc_server import (
    ServerHandle,
    announce_and_serve,
    create_server,
    start,
    start_metrics_server,
)
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.engine import GenerationEngine
from relayrl.generator.servicer import GeneratorServicer
from relayrl.generator.v1 import generator_pb2

logger = logging.getLogger(__name__)
DESCRIPTOR = generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"]
SERVICE = DESCRIPTOR.full_name


def build(engine: GenerationEngine, config: GeneratorConfig) -> ServerHandle:
    """The server around ``engine`` (bound, not started); tests pass a fake engine here."""
    servicer = GeneratorServicer(engine, config)
    handle = create_server(servicer, DESCRIPTOR, config.serve)
    servicer.set_ready = handle.set_ready  # readiness flips around weight swaps
    handle.on_shutdown.append(engine.shutdown)
    return handle


async def run(config: GeneratorConfig, port_file: str | None = None) -> str | None:
    """Start vLLM, serve until SIGTERM, drain, shut the engine down. Returns why the process
    must exit with an error (the engine died), or None after a requested shutdown."""
    from relayrl.generator.vllm_engine import VLLMEngine

    if not config.engine.model:
        raise SystemExit("generator: engine.model (--model) is required")
    # Bind first so a port clash fails before minutes of model loading; readiness stays
    # NOT_SERVING until the engine is up.
    replica_id = config.replica_id
    engine = VLLMEngine(config, replica_id)
    handle = build(engine, config)
    engine.replica_id = replica_id or f"{socket.gethostname()}:{handle.port}"
    await start(handle, ready=False)  # live while loading, ready once the engine is up
    metrics_port = start_metrics_server(config.serve.metrics_port, config.serve.host)
    await engine.start()
    logger.info(
        "generator %s serving %s on %s:%d (metrics port %s)",
        engine.replica_id,
        config.engine.model,
        config.serve.host,
        handle.port,
        metrics_port,
    )
    return await announce_and_serve(
        handle, "generator", config.serve.host, config.serve.grace_seconds, port_file, fatal=engine.died()
    )
