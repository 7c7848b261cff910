"""A cgroup per worker slot: what rlimits bound per process, bounded per job.

rlimits count each process on its own: a job of 15 processes uses 15 CPUs' worth of time, and its
memory is bounded only by processes x ``memory_mb``. Kernel socket buffers count against no rlimit
at all: loopback TCP pairs inside the job's network namespace can hold the host's whole TCP pool,
which the service's own gRPC connections share. A cgroup bounds the whole job: its memory (its
/tmp and, on cgroup v2, every socket buffer; on v1, TCP buffers under a limit of their own, the
same figure) and its CPU share. Its processes stay bounded by RLIMIT_NPROC, set inside its user
namespace: a pids limit would also count the job's processes the kernel has not yet released (a
second or two after they were reaped), and refuse the next job's first fork.

Where: under the service's own cgroup, one child per slot (``relayrl-sandbox-u<uid>`` for a slot
with a host user of its own, else ``relayrl-sandbox-p<pid>-<index>``), in cgroup v2 when the
service's cgroup delegates memory and cpu to its children, else in the v1 hierarchies of those
two controllers when they are writable (root in a VM or a privileged container). Nowhere else: a
container whose cgroups are read-only gets None, and the probe says so.

A job joins its slot's cgroup before anything of it runs: its first process (``sh``, still the
service's user) writes its own pid into each ``cgroup.procs`` and execs the sandbox command, so
every process the job forks is born inside.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass

from relayrl.common.sandbox.limits import SandboxLimits

logger = logging.getLogger(__name__)

ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "cpu")
_PERIOD_US = 100_000
_MIB = 1 << 20
_OOM_KILL = re.compile(r"^oom_kill (\d+)$", re.M)
JOIN_FAILED = 125
"""Exit status of a job whose first process could not join its cgroup (an infrastructure failure:
the sandbox reports it unavailable)."""
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


OVERHEAD_MB = 64
"""What a job's cgroup is charged beyond its processes' memory and its /tmp: the page cache of the
files it reads (the interpreter's own, ~30 MB), page tables, kernel objects. Left room so that one
process meets its own address-space limit (a clean MemoryError) before the job's bound, instead
of reclaiming page cache in a loop until its CPU limit."""


def job_memory_bytes(limits: SandboxLimits) -> int:
    """The whole job's memory bound: one process's address space, its /tmp, and the overhead.

    >>> job_memory_bytes(SandboxLimits(memory_mb=256, tmp_mb=16)) >> 20
    336
    """
    return (limits.memory_mb + limits.tmp_mb + OVERHEAD_MB) * _MIB


@dataclass
class SlotCgroup:
    """One slot's cgroup: a directory per controller (v1) or one directory (v2)."""

    version: int
    dirs: dict[str, str]
    """Controller -> directory (the same directory for all three on v2)."""
    written: dict[str, str]
    """File path -> the value last written (a job with the slot's usual limits writes nothing)."""

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` started so that its first process joins this cgroup."""
        procs = sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})
        return ["/bin/sh", "-c", _JOIN, "sh", *procs, "--", *argv]

    def apply(self, limits: SandboxLimits) -> None:
        """Write the job's bounds (before it starts; the slot is idle)."""
        memory, quota = job_memory_bytes(limits), max(1000, round(limits.cpus * _PERIOD_US))
        if self.version == 2:
            d = self.dirs["memory"]
            self._write(d, "memory.max", str(memory))
            self._write(d, "memory.swap.max", "0", optional=True)
            self._write(d, "cpu.max", f"{quota} {_PERIOD_US}")
            return
        m = self.dirs["memory"]
        self._write(m, "memory.limit_in_bytes", str(memory))
        self._write(m, "memory.kmem.tcp.limit_in_bytes", str(memory), optional=True)
        self._write(self.dirs["cpu"], "cpu.cfs_period_us", str(_PERIOD_US))
        self._write(self.dirs["cpu"], "cpu.cfs_quota_us", str(quota))

    def oom_kills(self) -> int:
        """How many processes the kernel has killed in this cgroup for memory so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs["memory"], name)) as f:
                m = _OOM_KILL.search(f.read())
        except OSError:
            return 0
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        for d in set(self.dirs.values()):
            try:
                os.rmdir(d)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    logger.warning("could not remove the sandbox cgroup %s: %s", d, e)

    def _write(self, d: str, name: str, value: str, optional: bool = False) -> None:
        path = os.path.join(d, name)
        if self.written.get(path) == value:
            return
        try:
            with open(path, "w") as f:
                f.write(value)
        except FileNotFoundError:
            if not optional:
                raise
            return
        self.written[path] = value


@dataclass(frozen=True)
class Cgroups:
    """Where slot cgroups are made: the service's own cgroup directory per controller."""

    version: int
    parents: dict[str, str]

    @classmethod
    def find(cls, root: str = ROOT, self_cgroup: str | None = None) -> tuple[Cgroups | None, str]:
        """The cgroups this process can make children in, and a line saying what was found (or
        why none). ``root`` and ``self_cgroup`` (the text of /proc/self/cgroup) are for tests."""
        if self_cgroup is None:
            try:
                with open("/proc/self/cgroup") as f:
                    self_cgroup = f.read()
            except OSError as e:
                return None, f"no cgroups: {e}"
        paths: dict[str, str] = {}
        for line in self_cgroup.splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else ["<v2>"]:
                paths[c] = path
        why = []
        if "<v2>" in paths:
            found, detail = cls._v2(root, paths["<v2>"])
            if found is not None:
                return found, detail
            why.append(detail)
        found, detail = cls._v1(root, paths)
        if found is not None:
            return found, detail
        why.append(detail)
        return None, "; ".join(why)

    @classmethod
    def _v2(cls, root: str, path: str) -> tuple[Cgroups | None, str]:
        top = (
            root
            if os.path.exists(os.path.join(root, "cgroup.controllers"))
            else os.path.join(root, "unified")
        )
        d = os.path.normpath(top + path)
        try:
            with open(os.path.join(d, "cgroup.controllers")) as f:
                have = set(f.read().split())
            if not set(CONTROLLERS) <= have:
                return None, f"cgroup v2 at {d} lacks {' '.join(sorted(set(CONTROLLERS) - have))}"
            with open(os.path.join(d, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
            missing = [c for c in CONTROLLERS if c not in enabled]
            if missing:  # refused (EBUSY) when processes live in d itself: not delegated
                with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                    f.write(" ".join(f"+{c}" for c in missing))
            if not os.access(d, os.W_OK):
                return None, f"cgroup v2 at {d} is not writable"
        except OSError as e:
            return None, f"cgroup v2 at {d} does not delegate {' '.join(CONTROLLERS)}: {e.strerror}"
        return cls(2, dict.fromkeys(CONTROLLERS, d)), f"cgroup v2 ({d})"

    @classmethod
    def _v1(cls, root: str, paths: dict[str, str]) -> tuple[Cgroups | None, str]:
        parents = {}
        for c in CONTROLLERS:
            d = os.path.normpath(os.path.join(root, c) + paths.get(c, "/"))
            if c not in paths or not os.path.exists(os.path.join(d, "cgroup.procs")):
                return None, f"no cgroup v1 {c} hierarchy at {os.path.join(root, c)}"
            if not os.access(d, os.W_OK):
                return None, f"cgroup v1 {c} at {d} is not writable"
            parents[c] = d
        return cls(1, parents), "cgroup v1 (" + ", ".join(parents.values()) + ")"

    def make(self, name: str) -> SlotCgroup:
        """The slot cgroup ``name`` (made, or taken over from a service that died holding it)."""
        dirs = {}
        for c, parent in self.parents.items():
            d = os.path.join(parent, name)
            os.makedirs(d, exist_ok=True)
            dirs[c] = d
        return SlotCgroup(self.version, dirs, {})
