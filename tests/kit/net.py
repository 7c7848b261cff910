"""Ports on loopback for tests."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: bound to port 0 and closed again, so
    it stays free until someone takes it. Only for a server that cannot bind port 0 itself (Ray's
    head): anything else binds port 0 and reads its port back, and a port to find refused is
    ``refused_port``'s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 where a connection is refused for as long as the block runs: bound
    and held, never listening. A port merely found free can be taken meanwhile by a server of a
    test beside this one, which would then answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
