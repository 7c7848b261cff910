"""POSIX shared-memory segments (``/dev/shm/<name>``) holding weight buckets on one host.

The learner creates a segment (readable by its own user only), maps it, fills it with the
buckets of a push and names it in ``UpdateWeights``; a generator worker reads the buckets from
it (``Reader``: checked to be a learner's segment, read with ``pread``), loads them and answers;
only then does the learner reuse the segment (it keeps one, sized to the plan, for the next push)
or remove it. Mapped with ``mmap`` directly rather than through ``multiprocessing.shared_memory``,
whose resource tracker (Python < 3.13) would remove a segment it merely opened when the opening
process exits.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
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
    """A segment this process made (``create``): mapped read/write, owner read/write only.
    ``view()`` is a uint8 tensor over the whole mapping (no copy). Readers on the other side use
    ``attach``, which never maps: see ``Reader``."""

    def __init__(self, name: str, size: int, mm: mmap.mmap):
        self.name, self.size, self._mm = name, size, mm

    @classmethod
    def create(cls, size: int, tag: str = "w") -> Segment:
        remove_orphans(tag)
        name = f"{PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(ROOT / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, max(1, size))
            mm = mmap.mmap(fd, max(1, size))
        finally:
            os.close(fd)
        return cls(name, size, mm)

    @staticmethod
    def attach(name: str) -> Reader:
        """Open another process's segment for reading (see ``Reader``)."""
        return Reader.open(name)

    def view(self):
        """A uint8 tensor over the mapping (writable)."""
        import torch

        return torch.frombuffer(self._mm, dtype=torch.uint8)[: self.size]

    def write(self, offset: int, data: bytes) -> None:
        self._mm[offset : offset + len(data)] = data

    def read_u64(self, at: int) -> int:
        return struct.unpack_from("<Q", self._mm, at)[0]

    def write_u64(self, at: int, value: int) -> None:
        struct.pack_into("<Q", self._mm, at, value)

    def close(self) -> None:
        """Unmap and remove the segment."""
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with the last view
            pass
        (ROOT / self.name).unlink(missing_ok=True)


class Reader:
    """Another process's segment, opened for reading by a generator on a caller's word.

    The name comes from a request, so the file must be what a learner makes and nothing else:
    a regular file directly in ``/dev/shm`` (opened without following a symbolic link, and
    without blocking, so a FIFO or a device named like a segment is refused at once, not waited
    on), with one link, owned by this process's user (the learner makes them 0600: only that
    user can read them anyway). It is read with ``pread``, never mapped: a mapping read past a
    file that its owner truncated meanwhile kills the process with SIGBUS; a short read is an
    error (``Truncated``). Errors name the segment, never its bytes.
    """

    def __init__(self, name: str, fd: int, size: int):
        self.name, self._fd, self.size = name, fd, size

    @classmethod
    def open(cls, name: str) -> Reader:
        if not valid_name(name):
            raise ValueError(f"{name!r} is not a relayrl shared-memory segment name")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(ROOT / name, flags)
        except FileNotFoundError:
            raise ValueError(f"shared-memory segment {name} does not exist") from None
        except OSError as e:  # ELOOP: a symbolic link; EACCES: not ours
            raise ValueError(f"{name} cannot be opened as a shared-memory segment ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
                raise ValueError(
                    f"{name} is not a shared-memory segment of this user (a regular file with one link)"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, st.st_size)

    def read_into(self, offset: int, out) -> None:
        """Fill ``out`` (a contiguous CPU uint8 tensor) with the bytes at ``offset``."""
        view = memoryview(out.numpy()).cast("B") if out.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise Truncated(
                    f"segment {self.name} ends before byte {offset + len(view)} (it was truncated)"
                )
            done += n

    def read_u64(self, at: int) -> int:
        data = os.pread(self._fd, 8, at)
        if len(data) != 8:
            raise Truncated(f"segment {self.name} ends before byte {at + 8} (it was truncated)")
        return struct.unpack("<Q", data)[0]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Truncated(ValueError):
    """A segment became shorter than its reader was told while it was being read."""


class ReadyTable:
    """Completion marks of a pipelined push: 16 bytes per bucket at ``offset`` of a segment, a
    mark and the bucket's checksum (little-endian uint64s). The learner writes bucket i, then its
    checksum, then the mark: the push's id when the bucket is complete, the id with bit 63 set
    when the push was given up. A reader waits for the mark and then checks the bytes against the
    checksum, re-reading briefly on a mismatch (on weakly ordered CPUs the data may become visible
    after the mark). Ids of later pushes differ, so marks left by an earlier push never match.
    ``segment`` is the learner's ``Segment`` (marks) or a generator's ``Reader`` (waits).

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

    def __init__(self, segment: Segment | Reader, offset: int, n: int):
        if offset < 0 or offset + n * self.ENTRY > segment.size:
            raise ValueError(f"a ready table of {n} buckets at {offset} does not fit segment {segment.name}")
        self._seg, self.offset, self.n = segment, offset, n

    def mark(self, i: int, push_id: int, checksum: int) -> None:
        at = self.offset + i * self.ENTRY
        self._seg.write_u64(at + 8, checksum)
        self._seg.write_u64(at, push_id)

    def abort(self, push_id: int) -> None:
        """Mark every bucket not yet complete as given up (readers stop waiting at once)."""
        for i in range(self.n):
            at = self.offset + i * self.ENTRY
            if self._seg.read_u64(at) != push_id:
                self._seg.write_u64(at, push_id | self.ABORTED)

    def wait(self, i: int, push_id: int, deadline: float) -> int:
        """Wait until bucket ``i`` of push ``push_id`` is complete; returns its checksum."""
        # Polls from 10 us, backing off to 2 ms: a bucket often completes within a millisecond
        # (a push over IPC is a few), and a wait that overshoots it costs the whole push.
        at, delay = self.offset + i * self.ENTRY, 1e-5
        while True:
            mark = self._seg.read_u64(at)
            if mark == push_id:
                return self._seg.read_u64(at + 8)
            if mark == push_id | self.ABORTED:
                raise RuntimeError(f"the learner gave up push {push_id} before bucket {i} was complete")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bucket {i} of push {push_id} was not complete in time")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)


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
