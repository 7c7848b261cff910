"""The coordinator's gRPC server (``relayrl serve coordinator``, and inside ``relayrl run``)."""

from __future__ import annotations

from relayrl.common.grpc_server import (
    ServerHandle,
    announce_and_serve,
    create_server,
    start,
    start_metrics_server,
)
from relayrl.coordinator.config import CoordinatorServeConfig
from relayrl.coordinator.service.registry import Registry
from relayrl.coordinator.service.servicer import CoordinatorServicer
from relayrl.coordinator.v1 import coordinator_pb2

DESCRIPTOR = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]
SERVICE = DESCRIPTOR.full_name


def build(registry: Registry, config: CoordinatorServeConfig | None = None) -> ServerHandle:
    """The server around ``registry`` (bound, not started); default: loopback, a free port."""
    config = config or CoordinatorServeConfig()
    servicer = CoordinatorServicer(registry, config)
    return create_server(servicer, DESCRIPTOR, config.serve)


async def run(config: CoordinatorServeConfig, port_file: str | None = None) -> None:
    """Serve an empty registry until SIGTERM; experiments arrive by StartExperiment."""
    registry = Registry(max_running=config.max_running)
    handle = build(registry, config)
    await start(handle, ready=True)
    start_metrics_server(config.serve.metrics_port, config.serve.host)

    async def stop_experiments() -> None:
        for run_id in list(registry.experiments):
            registry.request_stop(run_id)
        for h in registry.experiments.values():
            if h.task is not None:
                # wait: request_stop bounds it: the run ends its step, or is cancelled once
                # services.stop_grace_seconds have passed (at once if it was stopping already)
                await h.task

    handle.on_shutdown.append(stop_experiments)
    await announce_and_serve(handle, "coordinator", config.serve.host, config.serve.grace_seconds, port_file)
