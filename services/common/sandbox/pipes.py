"""Reading a sandbox job's output: its stdout and stderr pipes to their end, the job's exit, a
deadline or a byte cap, whichever comes first (``read_capped``), without ever reaping the job's
process (its pid and process group stay taken until the runner has killed what it left)."""

from __future__ import annotations

import os
import selectors
import subprocess
import time


def read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def _exited(pid: int) -> bool:
    """True once ``pid`` has ended; it stays unreaped (its pid and group id stay taken)."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None and info.si_pid == pid


def _take(fd: int, buf: bytearray, cap: int, sel: selectors.BaseSelector) -> bool:
    """One read of ``fd`` into ``buf`` (unregistered at its end): True when ``buf`` reached
    ``cap`` (the rest dropped). BlockingIOError when nothing is there to read."""
    chunk = os.read(fd, 1 << 16)
    if not chunk:
        sel.unregister(fd)
        return False
    if len(buf) + len(chunk) > cap:
        buf += chunk[: cap - len(buf)]
        return True
    buf += chunk
    return False


def read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until the process ends (both closed, or it exited and a process it
    left holds them), the deadline passes, or one passes ``cap`` bytes: (stdout, stderr,
    truncated, timed out). Never reaps the process."""
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out: bytearray(), err: bytearray()}
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(bufs[out]), bytes(bufs[err]), False, True
            events = sel.select(min(left, 0.05))
            for key, _ in events:
                if _take(key.fd, bufs[key.fd], cap, sel):
                    return bytes(bufs[out]), bytes(bufs[err]), True, False
            if not events and _exited(proc.pid):
                # All it wrote before it exited is in the pipes, possibly after the select above
                # timed out: read it to the end (else a last line written just then is lost).
                for fd in list(sel.get_map()):
                    while fd in sel.get_map():
                        try:
                            if _take(fd, bufs[fd], cap, sel):
                                return bytes(bufs[out]), bytes(bufs[err]), True, False
                        except BlockingIOError:  # drained; a process it left may write on
                            break
                break
    pause = 0.0005
    while not _exited(proc.pid):
        if time.monotonic() >= deadline:
            return bytes(bufs[out]), bytes(bufs[err]), False, True
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return bytes(bufs[out]), bytes(bufs[err]), False, False
