"""Ports on loopback for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: bound to port 0 and closed again, so
    it stays free until someone takes it (a server to start there, or a port to find refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
