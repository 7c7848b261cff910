"""What a sandboxed run is given and what it gives back: limits, config, verdicts, results.

Plain data, no processes: imported by service configs (``relayrl.env.config``) without starting
anything. The runner (``runner.py``) turns a :class:`SandboxLimits` into rlimits and bwrap flags and
a finished process into a :class:`RunResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field
from relayrl.common.config import StrictModel

Tier = Literal["full", "rlimits-only"]


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not run a job (bwrap missing or refused, no process could be
    started): an infrastructure failure, never the code's outcome. An env answers REDO, a reward
    service an error, never a score."""


class SandboxBusy(SandboxUnavailable):
    """``max_waiting`` jobs already wait for a worker: the service is overloaded (an
    infrastructure condition, never the code's outcome)."""


class SandboxUnsafe(RuntimeError):
    """The start-up probe found isolation missing (its message names each failed check); the
    service refuses to start unless its config chose the weaker tier ``rlimits-only``."""


class SandboxLimits(StrictModel):
    """Bounds on one run. Every limit binds the whole job (the program and anything it starts)."""

    model_config = ConfigDict(frozen=True)

    wall_seconds: float = Field(5.0, gt=0, le=600)
    """Wall-clock time from spawn to exit; past it the whole process tree is killed (TIMEOUT).
    Includes the interpreter's start-up (~20-40 ms)."""
    cpu_seconds: float = Field(2.0, gt=0, le=600)
    """CPU time of each process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU at the limit,
    SIGKILL one second later (TIMEOUT)."""
    memory_mb: int = Field(512, ge=64, le=65536)
    """Address space of each process (RLIMIT_AS): an allocation past it fails (MemoryError,
    verdict MEMORY). Python needs ~30 MB of it to start. With a slot cgroup (``SandboxConfig.
    cgroups``) the whole job, all its processes, its /tmp and its socket buffers, is bounded by
    this plus ``tmp_mb`` plus 64 MiB (the page cache and kernel objects charged to it; past the
    bound the kernel kills a process of the job: verdict MEMORY); without
    one, by ``processes`` x this plus ``tmp_mb``, socket buffers not counted (the seccomp filter
    refuses the other kernel memory no rlimit counts: System V IPC, memfds, queues, AIO)."""
    processes: int = Field(16, ge=4, le=4096)
    """Processes and threads the job may hold at once (RLIMIT_NPROC under a user of its own); the
    sandbox's own init counts as one. A fork past it fails with EAGAIN (a fork bomb stalls)."""
    cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs the whole job may keep busy at once (the slot cgroup's CPU quota): a job that starts
    many busy processes shares this much. Without a slot cgroup only ``cpu_seconds`` (per
    process) and ``wall_seconds`` bound it."""
    file_size_mb: int = Field(16, ge=0, le=4096)
    """Largest file the job may write (RLIMIT_FSIZE); past it a write fails (EFBIG)."""
    output_bytes: int = Field(65536, ge=1024, le=64 << 20)
    """Most bytes kept of stdout, and of stderr; one byte more and the job is killed
    (OUTPUT_TRUNCATED, ``truncated`` set, what was read kept)."""
    tmp_mb: int = Field(16, ge=1, le=4096)
    """Size of the private /tmp (a tmpfs, the job's working directory, where ``files`` go)."""
    open_files: int = Field(64, ge=16, le=65536)
    """Open file descriptors per process (RLIMIT_NOFILE)."""


class SandboxConfig(StrictModel):
    """A service's sandbox: the isolation tier, the default limits and how many jobs run at once."""

    tier: Tier = "full"
    """``full``: bubblewrap with every namespace (no network, no host processes or files), as a
    user of its own, under rlimits; the service refuses to start when the start-up probe finds it
    missing. ``rlimits-only``: a plain child process under rlimits, no namespaces (the code can
    reach the network and read what the service's user can; a service not run as root cannot set
    the process limit, which would count its own threads): only for trusted code or machines
    without user namespaces, chosen explicitly."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Limits of a run that names none."""
    workers: int = Field(2, ge=1, le=256)
    """Jobs running at once; the rest queue (first come, first served)."""
    max_waiting: int = Field(1024, ge=1, le=1_000_000)
    """Jobs that may wait for a worker at once; one more is refused as an overload (an env
    answers REDO, never a score). A job whose caller's deadline passes while it waits is dropped
    unstarted."""
    python: str = Field("", max_length=4096)
    """Interpreter run in the sandbox, an absolute path under /usr (the only host tree the sandbox
    sees); empty: /usr/bin/python3, else /usr/local/bin/python3 (python:3.11-slim images). The
    service's own interpreter may live where the sandbox user cannot read it."""
    bwrap: str = Field("bwrap", min_length=1, max_length=4096)
    """The bubblewrap executable (a name looked up in PATH, or a path)."""
    proc: bool = True
    """Mount a /proc of the sandbox's own pid namespace (it shows only the job's processes) and let
    bwrap forbid nested user namespaces (``--disable-userns``, which writes /proc/sys). Set False
    in containers whose runtime masks /proc and mounts /proc/sys read-only (Docker's and
    Kubernetes' defaults): the kernel then refuses a new procfs, so the job runs without /proc,
    and the seccomp filter alone refuses nested user namespaces (x86-64)."""
    cgroups: Literal["auto", "required", "off"] = "auto"
    """Bound each job as a whole in a cgroup of its worker slot (memory with socket buffers, and
    CPU: ``SandboxLimits``) where the service can make cgroups (root on a VM, or a
    delegated cgroup v2 subtree). ``auto``: where it can, else per-process limits only (the probe
    says which); ``required``: refuse to start without; ``off``: never."""
    packages_dir: str = Field("", max_length=4096)
    """Where requirements for sandboxed programs (a harness env's ``agent_requirements``) are
    installed, one read-only folder per requirements file and interpreter, shared by the
    replicas of a host; empty: ``$XDG_CACHE_HOME/relayrl/sandbox-packages``."""
    packages_timeout_seconds: float = Field(900.0, gt=0, le=86400)
    """Longest one install may take (a replica installs before it serves)."""
    uid_base: int = Field(61000, ge=1000, le=(1 << 31) - 4096)
    """When the service runs as root: each worker runs its jobs as a host user of its own, the first
    free ones from ``uid_base`` up (locked in /run/lock, so that two sandboxes never share one), so
    RLIMIT_NPROC binds (it never binds uid 0) and every process a job left is found by its user and
    killed. Unused otherwise (jobs run as the service's user,
    mapped to 65534 inside)."""


class Verdict(StrEnum):
    """How a run ended."""

    OK = "ok"
    """Ran to its end within its limits and exited 0."""
    TIMEOUT = "timeout"
    """Past the wall-clock or the CPU limit (killed)."""
    MEMORY = "memory"
    """An allocation failed under the memory limit (MemoryError as the last line of stderr)."""
    OUTPUT_TRUNCATED = "output_truncated"
    """Wrote more than ``output_bytes`` on stdout or stderr (killed)."""
    CRASHED = "crashed"
    """Exited non-zero (an uncaught exception, ``sys.exit(1)``); ``exit_code`` says which."""
    KILLED = "killed"
    """Ended by a signal it did not get from a limit (SIGSEGV, a ``kill`` of its own)."""


@dataclass(frozen=True)
class RunResult:
    """One finished run."""

    verdict: Verdict
    exit_code: int | None
    """Exit status when it exited; None when a signal ended it or it was killed."""
    signal: int | None
    """The signal that ended it (SIGKILL for a job killed at a limit), else None."""
    stdout: str
    """At most ``output_bytes`` bytes, decoded as UTF-8 (bad bytes replaced)."""
    stderr: str
    wall_seconds: float
    """From spawn to the end of the whole process tree."""
    truncated: bool
    """stdout or stderr was cut at ``output_bytes``."""
