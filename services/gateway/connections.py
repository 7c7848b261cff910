"""The gateway's listening sockets and the bounds on its connections. Sockets are accepted here,
not by asyncio's ``create_server``, and each connection wraps the handler aiohttp makes for it.

Why not aiohttp's ``TCPSite``:
- aiohttp has no deadline on a request's head. Its keep-alive timer covers a connection that
  never completes a first request only in recent releases (aio-libs/aiohttp#13681, in the 3.14.5
  tested here; this package takes 3.9 on), and by default keeps an idle connection an hour.
- asyncio's accept loop, out of file descriptors (EMFILE), logs "socket.accept() out of system
  resource" with a traceback for each connection waiting in the backlog, and schedules one retry
  per failure, each of which fails the same way (CPython 3.11
  ``selector_events._accept_connection``): a log and CPU storm that grows while the descriptors
  stay spent.
- A peer's connections cannot be counted, nor refused before each costs a handler.

What holds here, with ``Bounds`` from the gateway's ``http`` config:
- A connection has ``header_timeout_s`` to deliver a whole request head, counted from its opening
  and from the end of its previous answer, else it is closed (also an idle keep-alive one).
- At most ``max_connections`` are open (and at most half of ``RLIMIT_NOFILE``): at the bound, a
  new connection closes the one that has waited longest for a request head; when every one is
  busy with a request, accepting pauses and new ones wait in the kernel's backlog.
- At most ``max_per_peer`` are open from one address; more are closed as soon as accepted.
- Out of descriptors, accepting backs off (10 ms doubling to 1 s) and says so once per run.
- A request aiohttp cannot parse is logged once per peer, at WARNING, without a traceback: the
  client is at fault, and must not be able to fill the log. ``refused`` counts every case.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
import stat
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from aiohttp.http import HttpProcessingError
from aiohttp.log import server_logger
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.01, 1.0
EVICT_SCAN = 16
"""How many of the longest-waiting connections eviction looks at for one with nothing to write."""
REMEMBERED_PEERS = 4096
"""Peers whose refusals were logged; past it the oldest are forgotten (and may be logged again)."""


class ConnectionMetrics(Protocol):
    def refused(self, reason: str) -> None:
        """A connection or request refused below the routes: ``peer_connections``, ``evicted``,
        ``header_timeout``, ``full``, ``out_of_fds`` (or ``accept_error``), ``malformed``."""


@dataclass(frozen=True)
class Bounds:
    header_timeout_s: float
    max_connections: int
    max_per_peer: int


class Once:
    """Keys already seen, the newest ``size`` of them: what is logged once per peer."""

    def __init__(self, size: int = REMEMBERED_PEERS):
        self.size, self.seen = size, OrderedDict()

    def first(self, key: object) -> bool:
        """True the first time ``key`` comes (or once it was forgotten).

        >>> once = Once(size=2)
        >>> [once.first(k) for k in "aab"], once.first("c"), once.first("a")
        ([True, False, True], True, True)
        """
        if key in self.seen:
            self.seen.move_to_end(key)
            return False
        self.seen[key] = None
        if len(self.seen) > self.size:
            self.seen.popitem(last=False)
        return True


class _Slot:
    """One accepted socket's place in the counts; ``Connections.release`` frees it once."""

    __slots__ = ("peer", "released")

    def __init__(self, peer: str):
        self.peer, self.released = peer, False


class Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's handler inside (every transport event is passed on), its
    slot in the counts, and the deadline of its next request head."""

    def __init__(self, conns: Connections, handler: RequestHandler, slot: _Slot):
        self.conns, self.handler, self.slot = conns, handler, slot
        self.transport: asyncio.Transport | None = None
        self.busy = 0
        """Requests of this connection in the routes now (``Connections.begin``/``end``)."""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.handler.connection_made(transport)
        self.conns.opened(self)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.closed(self)
        self.handler.connection_lost(exc)

    def idle(self) -> bool:
        """No request in the routes, nothing left to write: waiting for a request head."""
        t = self.transport
        return not self.busy and t is not None and not t.is_closing() and not t.get_write_buffer_size()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class PeerLog:
    """What aiohttp's handler of one connection logs (``RequestHandler.logger``): a request it could
    not parse (``HttpProcessingError``) goes to ``Connections.malformed``; the rest as aiohttp logs
    it."""

    def __init__(self, conns: Connections, peer: str):
        self.conns, self.peer = conns, peer

    def exception(self, msg, *args, exc_info=True, **kw) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            self.conns.malformed(self.peer, exc)
        else:
            server_logger.exception(msg, *args, exc_info=exc_info, **kw)

    def __getattr__(self, name: str):  # debug, warning, ...: aiohttp's own logger
        return getattr(server_logger, name)


class Connections:
    """The open connections of one HTTP API, counted in all and by peer; which of them wait for a
    request head, oldest first; the requests in the routes (``begin``/``end``)."""

    def __init__(self, bounds: Bounds, metrics: ConnectionMetrics | None = None):
        self.bounds, self.metrics = bounds, metrics
        self.limit = bounds.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft // 2 < self.limit:
            self.limit = max(1, soft // 2)
            log.warning(
                "http.max_connections %d is more than half the file-descriptor limit (%d): at most %d",
                bounds.max_connections,
                soft,
                self.limit,
            )
        self.open = 0
        self.peers: Counter[str] = Counter()
        self.waiting: OrderedDict[Connection, None] = OrderedDict()
        self.by_handler: dict[RequestHandler, Connection] = {}
        self.changed = asyncio.Event()
        self.once = Once()

    # -- accepting -------------------------------------------------------------------------

    async def room(self) -> None:
        """Return once a new connection can be let in: below the bound, or one to evict."""
        while self.open >= self.limit and not self.waiting:
            self.changed.clear()
            # wait: until a connection closes or starts waiting for a head (every busy one ends
            # within its request's deadlines); the accept loop holds new ones in the backlog
            await self.changed.wait()

    def admit(self, peer: str) -> _Slot | None:
        """A slot for a connection just accepted from ``peer``, or None: refuse it."""
        if self.peers[peer] >= self.bounds.max_per_peer:
            self._refused("peer_connections")
            if self.once.first(("peer_connections", peer)):
                log.warning(
                    "refusing connections from %s: %d open (http.max_connections_per_peer); "
                    "logged once per peer",
                    peer,
                    self.peers[peer],
                )
            return None
        if self.open >= self.limit and not self._evict():
            self._refused("full")
            return None
        self.open += 1
        self.peers[peer] += 1
        return _Slot(peer)

    def release(self, slot: _Slot) -> None:
        if slot.released:
            return
        slot.released = True
        self.open -= 1
        self.peers[slot.peer] -= 1
        if not self.peers[slot.peer]:
            del self.peers[slot.peer]
        self.changed.set()

    def _evict(self) -> bool:
        """Close the connection that has waited longest for a request head (with nothing left to
        write); False when none has."""
        for conn in list(self.waiting)[:EVICT_SCAN]:
            if conn.idle():
                self._refused("evicted")
                self._forget(conn)
                self.release(conn.slot)  # its socket closes within this loop turn
                conn.close()
                return True
        return False

    def accept_failed(self, exc: OSError, first: bool) -> None:
        self._refused("out_of_fds" if exc.errno in OUT_OF_FDS else "accept_error")
        if first:
            log.warning(
                "accepting connections: %s, with %d open: backing off (up to %g s); not logged "
                "again until accepting works",
                exc.strerror or exc,
                self.open,
                MAX_BACKOFF_S,
            )

    # -- a connection's life ---------------------------------------------------------------

    def opened(self, conn: Connection) -> None:
        self.by_handler[conn.handler] = conn
        self._wait(conn)

    def closed(self, conn: Connection) -> None:
        self._forget(conn)
        self.by_handler.pop(conn.handler, None)
        self.release(conn.slot)

    def begin(self, handler: RequestHandler) -> None:
        """A request head arrived (the routes' middleware): no head deadline while it is served."""
        conn = self.by_handler.get(handler)
        if conn is not None:
            conn.busy += 1
            self._forget(conn)

    def end(self, handler: RequestHandler) -> None:
        """Its answer is written (or given up): the next head's deadline starts."""
        conn = self.by_handler.get(handler)
        if conn is not None:
            conn.busy -= 1
            if not conn.busy:
                self._wait(conn)

    def _wait(self, conn: Connection) -> None:
        self._forget(conn)
        self.waiting[conn] = None
        loop = asyncio.get_running_loop()
        conn.timer = loop.call_later(self.bounds.header_timeout_s, self._expire, conn)
        self.changed.set()

    def _forget(self, conn: Connection) -> None:
        self.waiting.pop(conn, None)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def _expire(self, conn: Connection) -> None:
        conn.timer = None
        if conn.idle():
            self._refused("header_timeout")
            self._forget(conn)
            conn.close()
        elif conn.transport is not None and not conn.transport.is_closing():
            # Still writing its last answer to a slow reader: the deadline counts from its end.
            loop = asyncio.get_running_loop()
            conn.timer = loop.call_later(self.bounds.header_timeout_s, self._expire, conn)

    # -- requests that do not parse ----------------------------------------------------------

    def malformed(self, peer: str, exc: Exception) -> None:
        """A request from ``peer`` that is not HTTP (aiohttp answers it 400), or whose body is not
        what its headers say: logged once per peer, without a traceback."""
        self._refused("malformed")
        if self.once.first(("malformed", peer)):
            log.warning(
                "malformed request from %s (%s: %s); further ones from it are not logged",
                peer,
                type(exc).__name__,
                str(exc)[:200],
            )

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refused(reason)


def _peer(addr) -> str:
    return addr[0] if isinstance(addr, tuple) else "unix"


class Listener:
    """What a ``GuardedSite`` holds as its server: the listening sockets and their accept loops."""

    def __init__(
        self,
        conns: Connections,
        sockets: list[socket.socket],
        handlers: Callable[[], RequestHandler],
        tls,
    ):
        self.conns, self.sockets, self.handlers, self.tls = conns, sockets, handlers, tls
        self.starting: set[asyncio.Task] = set()
        self.loops = [asyncio.ensure_future(self._accept(s)) for s in sockets]

    def close(self) -> None:
        for task in [*self.loops, *self.starting]:
            task.cancel()
        for s in self.sockets:
            s.close()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.0
        while True:
            await self.conns.room()
            try:
                conn, addr = await loop.sock_accept(sock)
            except (ConnectionAbortedError, InterruptedError):
                continue  # the client left before it was accepted
            except OSError as e:  # out of descriptors (or memory): wait for some to free up
                self.conns.accept_failed(e, first=not backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2 or FIRST_BACKOFF_S)
                await asyncio.sleep(backoff)
                continue
            if backoff:
                log.warning("accepting connections again (%d open)", self.conns.open)
                backoff = 0.0
            try:
                slot = self.conns.admit(_peer(addr))
            except Exception:  # a bug must not end accepting: this connection only is lost
                log.exception("admitting a connection from %s", addr)
                slot = None
            if slot is None:
                conn.close()
                continue
            task = asyncio.ensure_future(self._start(conn, slot))
            self.starting.add(task)
            task.add_done_callback(self.starting.discard)

    async def _start(self, conn: socket.socket, slot: _Slot) -> None:
        def protocol() -> Connection:
            handler = self.handlers()
            handler.logger = PeerLog(self.conns, slot.peer)
            return Connection(self.conns, handler, slot)

        tls = (
            {"ssl": self.tls, "ssl_handshake_timeout": self.conns.bounds.header_timeout_s} if self.tls else {}
        )
        try:
            await asyncio.get_running_loop().connect_accepted_socket(protocol, conn, **tls)
        except BaseException as e:
            # The TLS handshake failed or timed out (its transport closed the socket), or the site
            # stops: the slot is free either way.
            conn.close()
            self.conns.release(slot)
            if not isinstance(e, Exception):
                raise
            log.debug("connection from %s not started: %r", slot.peer, e)


def _bind_tcp(host: str | None, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address of ``host`` (as ``loop.create_server`` binds them), all
    on the port the first one got when ``port`` is 0."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            if sockets and port == 0:
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            s = socket.socket(family, kind, proto)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(backlog)
            s.setblocking(False)
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def _bind_unix(path: str, backlog: int) -> list[socket.socket]:
    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        os.unlink(path)  # a stale socket of an earlier run (as loop.create_unix_server does)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        s.listen(backlog)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return [s]


class GuardedSite(web.BaseSite):
    """An aiohttp site (TCP on ``host:port``, or a Unix socket at ``path``) whose connections
    ``conns`` bounds."""

    def __init__(
        self,
        runner: web.BaseRunner,
        conns: Connections,
        *,
        host: str | None = None,
        port: int = 0,
        path: str | None = None,
        ssl_context=None,
        backlog: int = 128,
    ):
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.conns, self.host, self.port, self.path = conns, host, port, path

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://unix:{self.path}:" if self.path else f"{scheme}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        if self.path:
            sockets = _bind_unix(self.path, self._backlog)
        else:
            sockets = _bind_tcp(self.host, self.port, self._backlog)
        server = self._runner.server
        assert server is not None
        self._server = Listener(self.conns, sockets, server, self._ssl_context)  # type: ignore[assignment]
