"""The processes of sandbox jobs on the host: found by their user, killed, reaped.

A root service runs each worker slot's jobs as a host user of its own, so "every process of that
user" is exactly "every process the slot's jobs started", whatever they did (``setsid``, double
forks, renaming themselves). Zombies are dead already: they are reaped when they are ours and never
counted as survivors.
"""

from __future__ import annotations

import os
import re
import signal
import time

_STATUS_UID = re.compile(rb"State:\s+(\S).*?\nUid:\s+(\d+)", re.S)


def pids_of_user(uid: int) -> list[tuple[int, bool]]:
    """Host pids whose real user is ``uid``, each with whether it is a zombie (from
    /proc/<pid>/status: a process cannot hide from it as it can from the owner of /proc/<pid>, by
    turning non-dumpable)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read(4096)
        except (FileNotFoundError, ProcessLookupError):
            continue
        m = _STATUS_UID.search(status)
        if m and int(m.group(2)) == uid:
            found.append((int(name), m.group(1) == b"Z"))
    return found


def kill_user(uid: int, timeout: float = 2.0) -> int:
    """SIGKILL every live process of ``uid`` until none is left (root only), reaping the zombies
    that are ours; the number still alive after ``timeout`` (0 normally). A process forking in a
    loop is caught by the repeats."""
    end = time.monotonic() + timeout
    while True:
        live = []
        for pid, zombie in pids_of_user(uid):
            if zombie:
                _reap(pid)
                continue
            live.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not live or time.monotonic() > end:
            return len(live)
        time.sleep(0.002)


def _reap(pid: int) -> bool:
    """Reap ``pid`` if it is an ended child of ours; True once it is gone or not ours."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def reap_init(pid: int, timeout: float = 2.0) -> bool:
    """Reap bwrap's pid 1 (``pid`` on the host) when it is ours. bwrap's outer process exits as
    soon as the program does, leaving its pid 1 to tear the namespace down (the kernel kills what
    is left) and to be reparented to the host's pid 1: in a container that is often the service
    itself, which must reap it, or a zombie is left per job. Elsewhere its init reaps it and this
    returns at once. False when it is ours and still there after ``timeout`` (then SIGKILLed)."""
    end = time.monotonic() + timeout
    pause = 0.0005
    while not _reap(pid):
        if time.monotonic() > end:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True
