"""A byte pump from a listening socket to one upstream address, standard library only.

Both forwarders of a harness env are this class: inside the sandbox (``bootstrap.py``) from TCP
127.0.0.1:8000 of the job's own network namespace to the Unix socket bind-mounted into it, and on
the host (``relayrl.env.forward``) from that Unix socket to the gateway's TCP host and port.
Imports nothing of relayrl: it is copied into the sandbox's /tmp as a file beside the agent.

One thread runs a selector loop for every connection (no thread per connection: inside the
sandbox threads count against the job's process limit, and on the host a thread cannot be
stopped, while ``close`` ends this one). Each accepted connection gets one upstream connection,
opened without blocking; bytes go both ways through buffers of at most ``BUFFER_BYTES`` (a side
is not read while its buffer is full), an end of file is passed on as a half close, and the pair
is closed once both ways are done or either side fails. At most ``max_connections`` pairs are
open at once; a connection past that is closed at once (the client sees a reset and may retry).
Idle connections are kept: a model's answer may take minutes.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time

logger = logging.getLogger(__name__)
BUFFER_BYTES = 1 << 18
"""Most bytes buffered in each direction of a connection."""
CONNECT_SECONDS = 10.0
"""An upstream connection not made within this is given up (the client's connection closed)."""
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class _Pair:
    """One client connection and its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket, connecting: bool):
        self.ends = (client, upstream)
        self.buffers = (bytearray(), bytearray())  # [i]: bytes read from ends[i], for the other end
        self.eof = [False, False]  # ends[i] sent its end of file
        self.shut = [False, False]  # ends[i] was told the other end's end of file (SHUT_WR)
        self.connecting = connecting
        self.connect_by = time.monotonic() + CONNECT_SECONDS

    def wants(self, i: int) -> int:
        """The events end ``i`` waits for."""
        if i == 1 and self.connecting:
            return _WRITE
        events = _READ if not self.eof[i] and len(self.buffers[i]) < BUFFER_BYTES else 0
        return events | (_WRITE if self.buffers[1 - i] else 0)

    def done(self) -> bool:
        return all(self.shut)


class Relay:
    """Pipe each connection accepted on ``listener`` to ``upstream`` (a socket family and
    address, e.g. ``(socket.AF_UNIX, "/run/relayrl/gateway.sock")``), in a thread of its own from
    ``start`` until ``close``."""

    def __init__(self, listener: socket.socket, upstream: tuple[int, object], max_connections: int = 16):
        self.listener = listener
        self.family, self.address = upstream
        self.max_connections = max_connections
        self.refused = 0
        """Connections closed at once because ``max_connections`` were open."""
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pairs: dict[socket.socket, tuple[_Pair, int]] = {}
        self._registered: dict[socket.socket, int] = {}
        self._closing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="relay", daemon=True)

    def start(self) -> Relay:
        self.listener.setblocking(False)
        self._selector.register(self.listener, _READ)
        self._selector.register(self._wake_r, _READ)
        self._thread.start()
        return self

    def open_connections(self) -> int:
        return len({id(p) for p, _ in self._pairs.values()})

    def close(self, timeout: float = 5.0) -> None:
        """Stop: every connection and the listener are closed. Idempotent, from any thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._thread.ident is None:  # never started
            self._shutdown()
            return
        try:
            self._wake_w.send(b"x")
        except OSError:  # the loop saw the flag first and closed it
            pass
        self._thread.join(timeout)  # the loop closes everything on its way out

    # ---- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing:
                for key, events in self._selector.select(timeout=1.0):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        break
                    elif key.fileobj in self._pairs:
                        pair, i = self._pairs[key.fileobj]
                        try:
                            self._serve(pair, i, events)
                        except Exception:  # a bug here must cost one connection, not all
                            logger.exception("relay: dropping a connection")
                            self._drop(pair)
                now = time.monotonic()
                for pair in {id(p): p for p, _ in self._pairs.values()}.values():
                    if pair.connecting and now > pair.connect_by:
                        self._drop(pair)
        finally:
            if self._closing:
                self._shutdown()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the client gave up: the others go on
                return
            if self.open_connections() >= self.max_connections:
                self.refused += 1
                client.close()
                continue
            client.setblocking(False)
            upstream = socket.socket(self.family, socket.SOCK_STREAM)
            upstream.setblocking(False)
            err = upstream.connect_ex(self.address)
            if err not in (0, errno.EINPROGRESS):  # refused, or a full Unix backlog (EAGAIN)
                client.close()
                upstream.close()
                continue
            pair = _Pair(client, upstream, connecting=err != 0)
            self._pairs[client], self._pairs[upstream] = (pair, 0), (pair, 1)
            self._update(pair)

    def _serve(self, pair: _Pair, i: int, events: int) -> None:
        end = pair.ends[i]
        try:
            if i == 1 and pair.connecting:
                if end.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    return self._drop(pair)
                pair.connecting = False
            else:
                if events & _WRITE and pair.buffers[1 - i]:
                    sent = end.send(pair.buffers[1 - i])
                    del pair.buffers[1 - i][:sent]
                room = BUFFER_BYTES - len(pair.buffers[i])
                if events & _READ and room > 0 and not pair.eof[i]:  # the event may be stale
                    chunk = end.recv(min(1 << 16, room))
                    if chunk:
                        pair.buffers[i].extend(chunk)
                    else:
                        pair.eof[i] = True
            # An end of file goes on once everything before it has: the other end's write side.
            for j in (0, 1):
                if pair.eof[j] and not pair.buffers[j] and not pair.shut[1 - j] and not pair.connecting:
                    pair.ends[1 - j].shutdown(socket.SHUT_WR)
                    pair.shut[1 - j] = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # reset, broken pipe: the pair is over
            return self._drop(pair)
        if pair.done():
            return self._drop(pair)
        self._update(pair)

    def _update(self, pair: _Pair) -> None:
        for i, end in enumerate(pair.ends):
            want, had = pair.wants(i), self._registered.get(end, 0)
            if want == had:
                continue
            if not want:
                self._selector.unregister(end)
            elif not had:
                self._selector.register(end, want)
            else:
                self._selector.modify(end, want)
            self._registered[end] = want

    def _drop(self, pair: _Pair) -> None:
        for end in pair.ends:
            if self._registered.pop(end, 0):
                self._selector.unregister(end)
            self._pairs.pop(end, None)
            end.close()

    def _shutdown(self) -> None:
        for pair in {id(p): p for p, _ in list(self._pairs.values())}.values():
            self._drop(pair)
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()
        self._selector.close()
