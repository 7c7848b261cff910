"""Build and run a reward replica: scoring pool + RewardService + health + metrics."""

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
from relayrl.reward.config import RewardConfig
from relayrl.reward.pool import ScoringPool
from relayrl.reward.servicer import RewardServicer
from relayrl.reward.v1 import reward_pb2
from relayrl.reward.worker import PluginError

logger = logging.getLogger(__name__)
DESCRIPTOR = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
SERVICE = DESCRIPTOR.full_name


def build(pool: ScoringPool, config: RewardConfig) -> ServerHandle:
    """The server around ``pool`` (bound, not started); shutting it down closes the pool, and
    readiness follows whether the pool can score (``ScoringPool.on_ready``)."""
    servicer = RewardServicer(pool, config)
    handle = create_server(servicer, DESCRIPTOR, config.serve)
    handle.on_shutdown.append(pool.close)
    pool.on_ready = lambda ready: asyncio.ensure_future(handle.set_ready(ready))
    return handle


def make_pool(config: RewardConfig) -> ScoringPool:
    return ScoringPool(
        config.workers,
        config.plugins,
        unready_after=config.respawn_failures_unready,
        give_up_seconds=config.respawn_give_up_seconds,
        sandbox_json=config.sandbox.model_dump_json() if config.sandbox is not None else "",
    )


async def run(config: RewardConfig, port_file: str | None = None) -> None:
    """Start the workers, serve until SIGTERM, drain, stop the workers. Exits with status 1
    (``SystemExit`` with the reason) when scoring workers can no longer be started, so that a
    supervisor restarts the replica instead of keeping one that cannot score."""
    pool = make_pool(config)
    handle = build(pool, config)  # bind first: a port clash fails before the workers start
    await start(handle, ready=False)  # live at once, ready once the workers are up
    try:
        await pool.start()
    except PluginError as e:
        await handle.stop(0)
        raise SystemExit(f"reward: {e}") from None
    metrics_port = start_metrics_server(config.serve.metrics_port, config.serve.host)
    logger.info(
        "reward serving %d data sources with %d workers on %s:%d (metrics port %s)",
        len(pool.scorers),
        config.workers,
        config.serve.host,
        handle.port,
        metrics_port,
    )
    died = await announce_and_serve(
        handle, "reward", config.serve.host, config.serve.grace_seconds, port_file, fatal=pool.died()
    )
    if died:
        raise SystemExit(f"{died}: exiting with status 1 to be restarted")
