"""Build and run an env replica: registry + session table + EnvService + health + metrics."""

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
from relayrl.common.sandbox import PackagesError, Sandbox, SandboxUnsafe, probe
from relayrl.env.config import EnvConfig
from relayrl.env.registry import PluginError, build_registry
from relayrl.env.servicer import EnvServicer
from relayrl.env.sessions import SessionTable
from relayrl.env.v1 import env_pb2

logger = logging.getLogger(__name__)
DESCRIPTOR = env_pb2.DESCRIPTOR.services_by_name["EnvService"]
SERVICE = DESCRIPTOR.full_name


def build(config: EnvConfig) -> ServerHandle:
    """The server (bound, not started) for the envs ``config`` names; call from inside the event
    loop that will serve (the lease reaper starts on it). Shutting it down closes every open
    session. Raises ``PluginError`` when a plugin cannot be loaded, ``SandboxUnsafe`` when an
    env that runs the model's code is served and the sandbox's start-up probe fails, and what an
    env's ``prepare`` raises (``PackagesError``: its agent's requirements do not install)."""
    specs = build_registry(
        config.plugins,
        config.reward_funcs,
        config.reward_weights,
        config.openenv,
        config.verifiers,
        config.agents,
    )
    table = SessionTable(specs, config)
    if any(spec.cls.needs_sandbox for spec in specs.values()):
        table.sandbox = start_sandbox(config)
    for spec in specs.values():  # e.g. a harness env's agent requirements, installed once
        spec.cls.prepare(table.sandbox)
    handle = create_server(EnvServicer(table, config), DESCRIPTOR, config.serve)
    table.on_ready = lambda ready: asyncio.ensure_future(handle.set_ready(ready))
    table.start()
    handle.on_shutdown.append(table.shutdown)
    if table.sandbox is not None:
        sandbox = table.sandbox

        async def close_sandbox() -> None:
            sandbox.close()

        handle.on_shutdown.append(close_sandbox)
    return handle


def start_sandbox(config: EnvConfig) -> Sandbox:
    """The replica's sandbox, probed (~0.2 s): SandboxUnsafe when tier ``full`` finds isolation
    missing; a warning naming what is missing for tier ``rlimits-only``."""
    sandbox = Sandbox.from_config(config.sandbox)
    report = probe(sandbox)
    logger.info("%s (python %s, %d workers)", report.summary(), report.python, sandbox.workers)
    return sandbox


async def run(config: EnvConfig, port_file: str | None = None) -> None:
    """Serve until SIGTERM, then drain and close the sessions. A plugin that cannot be loaded (or
    whose agent's requirements do not install) stops the process (status 1) before anything binds."""
    try:
        handle = build(config)
    except (PluginError, SandboxUnsafe, PackagesError) as e:
        raise SystemExit(f"env: {e}") from None
    await start(handle, ready=False)
    metrics_port = start_metrics_server(config.serve.metrics_port, config.serve.host)
    logger.info(
        "env serving on %s:%d, up to %d sessions (metrics port %s)",
        config.serve.host,
        handle.port,
        config.max_sessions,
        metrics_port,
    )
    await announce_and_serve(handle, "env", config.serve.host, config.serve.grace_seconds, port_file)
