"""Settings every gRPC service shares: where it listens, how it is watched, how it stops."""

from __future__ import annotations

from pydantic import Field
from relayrl.common.config import StrictModel


class ServeConfig(StrictModel):
    """Network and lifecycle settings of one service process."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: binding anything else is an explicit choice."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free port (printed at start and written to ``--port-file``)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus metrics port on the same host; None turns the metrics endpoint off, 0 picks one."""
    grace_seconds: float = Field(10.0, ge=0, le=3600)
    """On SIGTERM: seconds in-flight RPCs get to finish before they are cancelled."""
    max_message_mb: int = Field(256, ge=4, le=2048)
    """Largest gRPC message accepted or sent, in MiB (weight chunks and big batches need room)."""
