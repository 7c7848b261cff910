"""A client of a server under test: a channel to the port it bound on loopback, and its stubs."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2_grpc


@contextlib.asynccontextmanager
async def client(handle, stub: type, **extra):
    """Yield ``handle``, ``channel``, ``stub`` (the service's stub class on the channel),
    ``health`` and ``extra`` as attributes; closes the channel after (the server is the caller's
    to stop)."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield SimpleNamespace(
            handle=handle,
            channel=channel,
            stub=stub(channel),
            health=health_pb2_grpc.HealthStub(channel),
            **extra,
        )
    finally:
        await channel.close()
