"""One sandboxed job: the command line, the process, its output and its verdict.

In: the program's code, its stdin, files for its /tmp, limits and a worker slot; optionally host
paths bound into the job (``binds``, full tier only: a Unix socket a harness env's agent reaches
the gateway through) and environment variables (``env``; the job's environment is otherwise only
PATH and HOME). Out: a :class:`RunResult`. The pool (``pool.py``) decides when a job runs; this
module how.

The full tier's command, outside in::

    setpriv [--reuid U ...] --pdeathsig KILL --  # the slot's user (root only); dies with the service
      bwrap <namespaces, mounts> --    # user, pid, net, ipc, uts, cgroup namespaces; read-only /usr
        prlimit <rlimits> --           # set inside the new user namespace, before the program runs
          /usr/bin/python3 -I -S -B /tmp/main.py

Why the rlimits are set inside: RLIMIT_NPROC counts per user and user namespace and is checked at
every level up to the host. Set inside, it bounds the job's own processes; set on bwrap outside,
it would also count every thread of the service's user. It never binds uid 0, so a service run as
root starts bwrap as a user of the slot's own (from ``uid_base`` up, locked): it owns nothing else,
so every process a job leaves is found by its user and killed before the slot runs again.

The process tree ends with its pid namespace: bwrap is pid 1 inside, holds the program and dies
with its own parent (``--die-with-parent``); when pid 1 exits the kernel kills everything left in
the namespace, ``setsid`` or not. At a limit we SIGKILL the outer process group, and (as root) kill
what the slot's user still owns until nothing is left.

An infrastructure failure (bwrap missing or refused, a fork that fails) raises
``SandboxUnavailable``; what the code does is never one (see ``looks_like_bwrap_failure``).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from relayrl.common.sandbox.cgroups import JOIN_FAILED, SlotCgroup
from relayrl.common.sandbox.extras import env_args
from relayrl.common.sandbox.limits import RunResult, SandboxLimits, SandboxUnavailable, Tier, Verdict
from relayrl.common.sandbox.pipes import read_all, read_capped
from relayrl.common.sandbox.procs import kill_user, reap_init
from relayrl.common.sandbox.seccomp import filter_program

MAIN = "main.py"
"""The program's file name in its /tmp (``files`` may not use it)."""
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_MEMORY_ERROR = re.compile(r"^(?:[\w.]+\.)?\w*MemoryError\b")
_MIB = 1 << 20
_CHILD_PID = re.compile(rb'"child-pid"\s*:\s*(\d+)')


def resolve_python(configured: str = "") -> str:
    """The interpreter to run inside: ``configured``, else Debian's, else python:slim's."""
    candidates = [configured] if configured else ["/usr/bin/python3", "/usr/local/bin/python3"]
    for path in candidates:
        if not path.startswith("/usr/") or ".." in path.split("/"):
            raise ValueError(f"sandbox python must be an absolute path under /usr, got {path!r}")
        if os.access(path, os.X_OK):
            return path
    raise SandboxUnavailable(f"no interpreter for the sandbox at {' or '.join(candidates)}")


def check_files(files: Mapping[str, str] | None) -> dict[str, str]:
    """``files`` when each name is a plain file name (no directories) other than main.py."""
    out = dict(files or {})
    for name, text in out.items():
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name == MAIN:
            raise ValueError(f"sandbox file name must be a plain name other than {MAIN}, got {name!r:.80}")
        if not isinstance(text, str):
            raise ValueError(f"sandbox file {name}: content must be text")
    return out


def rlimit_args(limits: SandboxLimits, nproc: bool = True) -> list[str]:
    """prlimit's flags for ``limits``: CPU (soft, then SIGKILL one second later), address space,
    processes, file size, open files, no core files.

    >>> rlimit_args(SandboxLimits(cpu_seconds=1.5, memory_mb=256))[:2]
    ['--cpu=2:3', '--as=268435456']
    """
    cpu = math.ceil(limits.cpu_seconds)
    args = [
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={limits.memory_mb * _MIB}",
        f"--fsize={limits.file_size_mb * _MIB}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if nproc:
        args.insert(2, f"--nproc={limits.processes}")
    return args


def bwrap_argv(
    bwrap: str,
    python: str,
    limits: SandboxLimits,
    fds: Mapping[str, int],
    status_fd: int | None = None,
    proc: bool = True,
    uid: int | None = None,
    seccomp_fd: int | None = None,
    binds: Mapping[str, str] | None = None,
    env_fd: int | None = None,
) -> list[str]:
    """The full tier's command; ``fds`` maps each /tmp file name (main.py first) to the open file
    descriptor bwrap copies it from; bwrap reports its init's host pid on ``status_fd``. ``binds``
    (checked by ``check_binds``) are mounted read-only: a Unix socket in one still takes
    connections (connecting needs write permission on the socket, not a writable mount), and the
    job can neither replace nor remove it. ``env_fd`` holds more bwrap arguments (``env_args``:
    the job's extra environment), read after PATH and HOME are set; through a descriptor, so that
    a secret (an API key) never shows in the host's process list."""
    argv = [*setpriv(uid), bwrap]
    argv += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    if proc:  # it writes /proc/sys, which container runtimes mount read-only (seccomp refuses too)
        argv += ["--disable-userns"]
    argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if status_fd is not None:
        argv += ["--json-status-fd", str(status_fd)]
    argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    argv += ["--ro-bind", "/usr", "/usr"]
    argv += [
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--symlink",
        "usr/bin",
        "/bin",
    ]
    if proc:
        argv += ["--proc", "/proc"]
    argv += dev_args()
    argv += ["--size", str(limits.tmp_mb * _MIB), "--tmpfs", "/tmp"]
    for name, fd in fds.items():
        argv += ["--file", str(fd), f"/tmp/{name}"]
    for host, inside in (binds or {}).items():
        argv += ["--ro-bind", host, inside]
    # bwrap builds / and /dev on tmpfs mounts of no set size: read-only, so that /tmp (sized) is
    # the only place a job can write to memory (device nodes such as /dev/null still take writes).
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--chdir", "/tmp", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    if env_fd is not None:
        argv += ["--args", str(env_fd)]
    argv += ["--", "prlimit", *rlimit_args(limits), "--", python, "-I", "-S", "-B", f"/tmp/{MAIN}"]
    return argv


DEVICES = ("null", "zero", "full", "random", "urandom")
"""The host device nodes a job's /dev holds. No ``ptmx`` and no ``pts``: every devpts instance
draws on the kernel-wide pty pool (``kernel.pty.max``), which a job could empty; no ``tty``
either (a job has no terminal)."""


def dev_args() -> list[str]:
    """bwrap's flags for the job's /dev: a tmpfs with only :data:`DEVICES` bound in, and the
    ``fd`` and standard stream links that programs expect (bwrap's own ``--dev`` adds a devpts
    with ``ptmx``)."""
    argv = ["--tmpfs", "/dev"]
    for name in DEVICES:
        argv += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    links = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1"}
    for name, target in {**links, "stderr": "/proc/self/fd/2"}.items():
        argv += ["--symlink", target, f"/dev/{name}"]
    return argv


def plain_argv(python: str, limits: SandboxLimits, nproc: bool, uid: int | None = None) -> list[str]:
    """The rlimits-only tier's command (run in a private temporary directory)."""
    return [*setpriv(uid), "prlimit", *rlimit_args(limits, nproc), "--", python, "-I", "-S", "-B", MAIN]


def setpriv(uid: int | None) -> list[str]:
    """The command's head: become ``uid`` (its own group, no supplementary groups) when given, and
    die with the service (SIGKILL when it exits, set after the user change, which clears it).
    Changing the user here and not in the forked child lets Python spawn with vfork: no fork
    handlers of the service's libraries (gRPC's) run in the child.

    >>> setpriv(61000)
    ['setpriv', '--reuid', '61000', '--regid', '61000', '--clear-groups', '--pdeathsig', 'KILL', '--']
    """
    user = [] if uid is None else ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"]
    return ["setpriv", *user, "--pdeathsig", "KILL", "--"]


def verdict_of(
    returncode: int, stderr: str, *, timed_out: bool, truncated: bool, via_bwrap: bool
) -> tuple[Verdict, int | None, int | None]:
    """(verdict, exit code, signal) of an ended job. bwrap reports a program ended by signal N as
    exit status 128 + N (so ``sys.exit(137)`` reads as SIGKILL: a program that wants to be
    believed exits below 128).

    >>> verdict_of(0, "", timed_out=False, truncated=False, via_bwrap=True)
    (<Verdict.OK: 'ok'>, 0, None)
    >>> verdict_of(1, "Traceback...\\nMemoryError\\n", timed_out=False, truncated=False, via_bwrap=True)
    (<Verdict.MEMORY: 'memory'>, 1, None)
    >>> verdict_of(128 + 24, "", timed_out=False, truncated=False, via_bwrap=True)
    (<Verdict.TIMEOUT: 'timeout'>, None, 24)
    """
    if timed_out:
        return Verdict.TIMEOUT, None, signal.SIGKILL
    if truncated:
        return Verdict.OUTPUT_TRUNCATED, None, signal.SIGKILL
    sig = -returncode if returncode < 0 else (returncode - 128 if via_bwrap and returncode > 128 else None)
    if sig is not None:
        return (Verdict.TIMEOUT if sig == signal.SIGXCPU else Verdict.KILLED), None, sig
    lines = [line for line in stderr.splitlines() if line.strip()]
    if returncode != 0 and lines and _MEMORY_ERROR.match(lines[-1]):
        return Verdict.MEMORY, returncode, None
    return (Verdict.OK if returncode == 0 else Verdict.CRASHED), returncode, None


def looks_like_bwrap_failure(returncode: int, stdout: bytes, stderr: bytes) -> bool:
    """bwrap could not build the sandbox (it exits 1 with one ``bwrap: ...`` line), could not be
    started (setpriv exits 126/127), or the job could not join its slot's cgroup (``sh`` exits
    125): the program never ran. A program can print the same, so
    the pool checks the sandbox once more before it believes it (``Sandbox._confirm_failure``)."""
    if stdout or stderr.count(b"\n") > 1:
        return False
    return (
        (returncode == 1 and stderr.startswith(b"bwrap: "))
        or (returncode in (126, 127) and stderr.startswith(b"setpriv: failed to execute"))
        or (returncode == JOIN_FAILED and stderr.startswith(b"sh: "))
    )


def _memfd(name: str, text: str | bytes) -> int:
    fd = os.memfd_create(name, 0)  # not CLOEXEC-free: pass_fds makes it inheritable
    data = text.encode() if isinstance(text, str) else text
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass(frozen=True)
class Slot:
    """A worker's identity: its index, its own host user when the service is root, and its
    cgroup where the service can make one."""

    index: int
    uid: int | None
    cgroup: SlotCgroup | None = None


@dataclass(frozen=True)
class Job:
    code: str
    stdin: str
    files: dict[str, str]
    limits: SandboxLimits
    binds: dict[str, str] = field(default_factory=dict)
    """Host path -> path inside (full tier only; ``check_binds``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables (``check_env``)."""
    deadline: float | None = None
    """``time.monotonic()`` past which nobody waits for the result: the job is not started after
    it, and killed at it (TIMEOUT) when it runs that long."""


def run_job(
    job: Job, slot: Slot, *, tier: Tier, bwrap: str, python: str, proc: bool = True
) -> tuple[RunResult, bool]:
    """Run ``job`` in ``slot``: its result, and whether it looks like bwrap failed to start (to
    be confirmed by the caller before it is believed)."""
    fds: dict[str, int] = {}  # the job's files, copied into its /tmp by bwrap
    extra: list[int] = []  # other descriptors bwrap reads (the seccomp filter, the env)
    tmpdir = None
    stdin_fd = _memfd("stdin", job.stdin)
    status = None
    try:
        if tier == "full":
            fds[MAIN] = _memfd(MAIN, job.code)
            for name, text in job.files.items():
                fds[name] = _memfd(name, text)
            status = os.pipe()
            program = filter_program()
            if program is not None:
                extra.append(_memfd("seccomp", program))
            seccomp_fd = extra[0] if extra else None
            env_fd = None
            if job.env:
                env_fd = _memfd("env", env_args(job.env))
                extra.append(env_fd)
            argv = bwrap_argv(
                bwrap, python, job.limits, fds, status[1], proc, slot.uid, seccomp_fd, job.binds, env_fd
            )
            cwd = "/"
        else:
            if job.binds:  # no mount namespace to bind into (the pool refuses these jobs first)
                raise ValueError("sandbox binds need tier full")
            tmpdir = tempfile.mkdtemp(prefix="relayrl-sandbox-")
            for name, text in {MAIN: job.code, **job.files}.items():
                with open(os.path.join(tmpdir, name), "w") as f:
                    f.write(text)
            if slot.uid is not None:
                for p in [tmpdir, *(os.path.join(tmpdir, n) for n in os.listdir(tmpdir))]:
                    os.chown(p, slot.uid, slot.uid)
            argv, cwd = plain_argv(python, job.limits, slot.uid is not None, slot.uid), tmpdir
        # The rlimits-only tier's job inherits the environment of setpriv and prlimit; bwrap's is
        # set by its arguments (``env_fd``).
        env = job.env if tier != "full" else None
        ooms = 0
        if slot.cgroup is not None:
            slot.cgroup.apply(job.limits)
            ooms = slot.cgroup.oom_kills()
            argv = slot.cgroup.join_argv(argv)
        end = time.monotonic() + job.limits.wall_seconds
        if job.deadline is not None:
            end = min(end, job.deadline)
        result, suspect = _spawn_and_wait(
            argv, cwd, stdin_fd, [*fds.values(), *extra], job.limits, slot, status, env, end
        )
        if slot.cgroup is not None and slot.cgroup.oom_kills() > ooms and result.verdict is Verdict.KILLED:
            result = replace(result, verdict=Verdict.MEMORY)  # the job as a whole ran out of memory
        return result, suspect
    finally:
        for fd in [stdin_fd, *fds.values(), *extra, *(status or ())]:
            os.close(fd)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _spawn_and_wait(
    argv: list[str],
    cwd: str,
    stdin_fd: int,
    pass_fds: list[int],
    limits: SandboxLimits,
    slot: Slot,
    status: tuple[int, int] | None,
    env: Mapping[str, str] | None,
    end: float,
) -> tuple[RunResult, bool]:
    via_bwrap = status is not None
    if status is not None:
        pass_fds = [*pass_fds, status[1]]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
            cwd=cwd, env={**(env or {}), "PATH": "/usr/bin:/bin"}, start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        raise SandboxUnavailable(f"cannot start the sandbox ({argv[0]}): {e}") from e
    try:
        out, err, truncated, timed_out = read_capped(proc, end, limits.output_bytes)
    finally:
        # The outer process is not reaped yet, so its group id cannot have been reused: kill the
        # group (the rlimits-only tier's children that stayed in it; the full tier's bwrap).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stdout.close()
        proc.stderr.close()
        returncode = proc.wait()
        if status is not None:
            m = _CHILD_PID.search(read_all(status[0]))
            if m and not reap_init(int(m.group(1))):
                raise SandboxUnavailable("the sandbox's pid 1 outlived its job")
        if slot.uid is not None and kill_user(slot.uid):
            raise SandboxUnavailable(f"processes of sandbox user {slot.uid} survive SIGKILL")
    wall = time.monotonic() - start
    stderr = err.decode("utf-8", "replace")
    verdict, code, sig = verdict_of(
        returncode, stderr, timed_out=timed_out, truncated=truncated, via_bwrap=via_bwrap
    )
    result = RunResult(verdict, code, sig, out.decode("utf-8", "replace"), stderr, wall, truncated)
    suspect = not (truncated or timed_out) and looks_like_bwrap_failure(returncode, out, err)
    return result, suspect
