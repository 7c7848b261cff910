"""Rank 0 -> other ranks command channel: a JSON header plus raw bytes, over a gloo group; and
the heartbeat that bounds how long any rank waits for the others.

Every collective operation starts with rank 0 sending a command; the other ranks wait in
``recv`` and then run the same method. Bytes, not pickle, cross it (the payload of a train step
is the TrainStepRequest protobuf rank 0 received). The group is gloo even when training runs on
NCCL, with a long timeout: followers legitimately wait as long as rank 0 has no work. What bounds
that wait is the ``Heartbeat``, on a gloo group of its own: rank 0 beats every
``timeout / 10`` seconds; a follower that hears nothing for ``timeout`` seconds (rank 0 hung,
stopped, or cut off without its connections closing) gives up, and so does rank 0 when a follower
does not take a beat. Neither can tell what the other is doing, so giving up means exiting: the
ranks' supervisor (torchrun, Ray, Kubernetes) restarts the learner, and the coordinator resumes
from the last checkpoint. A dead peer whose connections close is seen at once, without it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Control:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(days=30))
        self.broken: str | None = None
        """Why the channel can no longer be used (a send that did not complete), or None."""

    def send(self, cmd: dict, payload: bytes = b"", timeout: float | None = None) -> None:
        """Rank 0: broadcast a command; within ``timeout`` seconds when given (else as long as
        the followers take to finish their part of the previous operation)."""
        header = json.dumps(cmd).encode()
        sizes = torch.tensor([len(header), len(payload)], dtype=torch.int64)
        buf = (
            torch.frombuffer(bytearray(header + payload), dtype=torch.uint8)
            if header or payload
            else torch.empty(0, dtype=torch.uint8)
        )
        try:
            for tensor in (sizes, buf):
                work = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=timeout))
        except Exception as e:
            self.broken = f"command {cmd.get('op')!r} not taken by every rank: {e}"
            raise

    def gather_text(self, text: str, limit: int = 512) -> list[str]:
        """Every rank's ``text`` (cut to ``limit`` UTF-8 bytes), in rank order, on every rank."""
        data = text.encode()[:limit]
        buf = torch.zeros(limit + 2, dtype=torch.uint8)
        buf[:2] = torch.tensor([len(data) >> 8, len(data) & 0xFF], dtype=torch.uint8)
        if data:
            buf[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, buf, group=self.group)
        texts = []
        for b in out:
            n = (int(b[0]) << 8) | int(b[1])
            texts.append(b[2 : 2 + n].numpy().tobytes().decode(errors="replace"))
        return texts

    def recv(self) -> tuple[dict, bytes]:
        sizes = torch.empty(2, dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.group)
        n_header, n_payload = int(sizes[0]), int(sizes[1])
        buf = torch.empty(n_header + n_payload, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        data = buf.numpy().tobytes()
        return json.loads(data[:n_header]), data[n_header:]


_BEAT, _BYE = 1, 0


class Heartbeat:
    """Liveness between rank 0 and the other ranks (see the module docstring), on a thread of its
    own on every rank. ``on_lost(reason)`` is called once, from that thread, when the others
    cannot be reached within ``timeout`` seconds. Created collectively, after ``Control``."""

    def __init__(self, timeout: float, on_lost: Callable[[str], None]):
        self.timeout = timeout
        self.every = timeout / 10
        self.on_lost = on_lost
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.rank = dist.get_rank()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat if self.rank == 0 else self._listen, name="relayrl-heartbeat", daemon=True
        )

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """End the heartbeat: rank 0 sends its last beat (which ends the followers' too) and waits
        for it at most ``timeout`` seconds (default: the heartbeat's); a follower waits for it."""
        self._stop.set()
        self._thread.join(self.timeout if timeout is None else timeout)

    def _exchange(self, value: int) -> int:
        beat = torch.tensor([value], dtype=torch.int8)
        dist.broadcast(beat, src=0, group=self.group, async_op=True).wait(timedelta(seconds=self.timeout))
        return int(beat[0])

    def _beat(self) -> None:
        while True:
            bye = self._stop.wait(self.every)
            try:
                self._exchange(_BYE if bye else _BEAT)
            except Exception as e:
                if not bye:
                    self._lost(
                        f"a learner rank did not take rank 0's heartbeat within {self.timeout:g}s ({e})"
                    )
                return
            if bye:
                return

    def _listen(self) -> None:
        while True:
            try:
                if self._exchange(0) == _BYE:
                    return
            except Exception as e:
                if not self._stop.is_set():
                    self._lost(
                        f"rank {self.rank} has not heard rank 0's heartbeat for {self.timeout:g}s ({e})"
                    )
                return

    def _lost(self, reason: str) -> None:
        logger.error("%s", reason)
        self.on_lost(reason)
