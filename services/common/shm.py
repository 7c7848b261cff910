"""POSIX shared-memory segments (``/dev/shm/<name>``) holding weight buckets on one host.

The learner creates a segment (readable by its own user only), fills it with the buckets of a
push and names it in ``UpdateWeights``; a generator worker maps it, loads the tensors from it
and answers; only then does the learner reuse the segment (it keeps one, sized to the plan, for
the next push) or remove it. Mapped with ``mmap`` directly rather than through
``multiprocessing.shared_memory``, whose resource tracker (Python < 3.13) would remove a
segment it merely opened when the opening process exits.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import time
from pathlib import Path

ROOT = Path("/dev/shm")
PREFIX = "relayrl-"


def valid_name(name: str) -> bool:
    """A segment name relayrl makes: a plain file name with its prefix, nothing else.

    >>> valid_name("relayrl-w-1f2e"), valid_name("../etc/passwd"), valid_name("relayrl-/x")
    (True, False, False)
    """
    return name.startswith(PREFIX) and len(name) <= 128 and name.replace("-", "").replace("_", "").isalnum()


class Segment:
    """A mapped segment. ``create`` makes a new one (owner read/write only); ``attach`` maps an
    existing one read-only. ``view()`` is a uint8 tensor over the whole mapping (no copy)."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name, self.size, self._mm, self.owner = name, size, mm, owner

    @classmethod
    def create(cls, size: int, tag: str = "w") -> Segment:
        remove_orphans(tag)
        name = f"{PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(ROOT / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(1, size))
            mm = mmap.mmap(fd, max(1, size))
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        if not valid_name(name):
            raise ValueError(f"{name!r} is not a relayrl shared-memory segment name")
        fd = os.open(ROOT / name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def view(self, writable: bool = False):
        """A uint8 tensor over the mapping (writable only for the owner's mapping)."""
        import warnings

        import torch

        if writable and not self.owner:
            raise ValueError(f"segment {self.name} is mapped read-only here")
        with warnings.catch_warnings():  # a read-only mapping: nothing writes through the view
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._mm, dtype=torch.uint8)[: self.size]

    def write(self, offset: int, data: bytes) -> None:
        self._mm[offset : offset + len(data)] = data

    def close(self) -> None:
        """Unmap; the owner also removes the segment."""
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with the last view
            pass
        if self.owner:
            (ROOT / self.name).unlink(missing_ok=True)


class ReadyTable:
    """Completion marks of a pipelined push: 16 bytes per bucket at ``offset`` of a segment, a
    mark and the bucket's checksum (little-endian uint64s). The learner writes bucket i, then its
    checksum, then the mark: the push's id when the bucket is complete, the id with bit 63 set
    when the push was given up. A reader waits for the mark and then checks the bytes against the
    checksum, re-reading briefly on a mismatch (on weakly ordered CPUs the data may become visible
    after the mark). Ids of later pushes differ, so marks left by an earlier push never match.

    >>> seg = Segment.create(64, tag="doc")
    >>> t = ReadyTable(seg, 0, 2)
    >>> t.mark(1, push_id=7, checksum=99); t.wait(1, 7, time.monotonic() + 1)
    99
    >>> t.abort(7); t.wait(0, 7, time.monotonic() + 1)
    Traceback (most recent call last):
    ...
    RuntimeError: the learner gave up push 7 before bucket 0 was complete
    >>> seg.close()
    """

    ENTRY = 16
    ABORTED = 1 << 63

    def __init__(self, segment: Segment, offset: int, n: int):
        if offset < 0 or offset + n * self.ENTRY > segment.size:
            raise ValueError(f"a ready table of {n} buckets at {offset} does not fit segment {segment.name}")
        self._mm, self.offset, self.n = segment._mm, offset, n

    def mark(self, i: int, push_id: int, checksum: int) -> None:
        at = self.offset + i * self.ENTRY
        struct.pack_into("<Q", self._mm, at + 8, checksum)
        struct.pack_into("<Q", self._mm, at, push_id)

    def abort(self, push_id: int) -> None:
        """Mark every bucket not yet complete as given up (readers stop waiting at once)."""
        for i in range(self.n):
            if struct.unpack_from("<Q", self._mm, self.offset + i * self.ENTRY)[0] != push_id:
                struct.pack_into("<Q", self._mm, self.offset + i * self.ENTRY, push_id | self.ABORTED)

    def wait(self, i: int, push_id: int, deadline: float) -> int:
        """Wait until bucket ``i`` of push ``push_id`` is complete; returns its checksum."""
        at, delay = self.offset + i * self.ENTRY, 1e-4
        while True:
            mark = struct.unpack_from("<Q", self._mm, at)[0]
            if mark == push_id:
                return struct.unpack_from("<Q", self._mm, at + 8)[0]
            if mark == push_id | self.ABORTED:
                raise RuntimeError(f"the learner gave up push {push_id} before bucket {i} was complete")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bucket {i} of push {push_id} was not complete in time")
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)


def remove_orphans(tag: str) -> list[str]:
    """Remove this user's ``tag`` segments whose creator is gone (a learner killed before it could
    clean up leaves one behind, the size of a model). Returns their names."""
    gone = []
    for path in ROOT.glob(f"{PREFIX}{tag}-*-*"):
        try:
            pid = int(path.name[len(PREFIX) + len(tag) + 1 :].split("-")[0])
            if path.stat().st_uid != os.getuid() or _alive(pid):
                continue
            path.unlink()
            gone.append(path.name)
        except (ValueError, OSError):
            continue
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
