"""The host side of a harness env's way to the gateway: a Unix socket piped to the gateway's TCP
address, one per episode.

In: the episode's gateway ``base_url`` (its host and port; the path stays with the agent's URL).
Out: ``GatewayForwarder.path``, a Unix socket in a private temporary folder made for this episode,
which the harness bind-mounts into the sandbox (``Sandbox.run_sync(binds=...)``); each connection
to it is piped to the gateway by a ``Relay`` (``agents/relay.py``: one selector thread, bounded
connections) until ``close``.

Permissions: the job runs as another user than the service (the slot's own host user, from
``sandbox.uid_base``, when the service is root; which slot is not known in advance), so the
folder is 0711 (others may pass through, not list it) and the socket 0666 (connecting needs write
permission). A local user who finds the socket reaches no more than the gateway's own TCP port
already offers them, and every request there needs the episode's key.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from urllib.parse import urlsplit

from relayrl.env.agents.relay import Relay

SOCKET_NAME = "gateway.sock"
MAX_CONNECTIONS = 16
"""Connections to the gateway open at once per episode (an agent needs one or two)."""


def gateway_address(base_url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL; ValueError when it has no host or a bad port.

    >>> gateway_address("http://127.0.0.1:8123/v1"), gateway_address("https://gw.example/v1")
    (('127.0.0.1', 8123), ('gw.example', 443))
    """
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"gateway base_url must be http(s)://host[:port]/..., got {base_url!r:.120}")
    try:
        port = parts.port
    except ValueError as e:  # not a number, or out of range
        raise ValueError(f"gateway base_url {base_url!r:.120}: {e}") from None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


class GatewayForwarder:
    """A Unix socket at ``path`` whose connections are piped to the gateway of ``base_url``.
    Raises OSError when the gateway's name does not resolve or the socket cannot be made."""

    def __init__(self, base_url: str, max_connections: int = MAX_CONNECTIONS):
        host, port = gateway_address(base_url)
        # Resolved once, here (in the env's thread): the relay's loop never blocks on a lookup.
        # IPv4 first: "localhost" may resolve to ::1 first while the gateway listens on 0.0.0.0.
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = next((a for a in found if a[0] == socket.AF_INET), found[0])
        self.folder = tempfile.mkdtemp(prefix="relayrl-gw-")
        self.path = os.path.join(self.folder, SOCKET_NAME)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.chmod(self.folder, 0o711)
            listener.bind(self.path)
            os.chmod(self.path, 0o666)
            listener.listen(max_connections)
            self.relay = Relay(listener, (family, address), max_connections).start()
        except BaseException:
            listener.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def close(self) -> None:
        """Close every connection and the socket, remove the folder. Idempotent."""
        self.relay.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> GatewayForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
