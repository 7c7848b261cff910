"""The sandbox a service builds once: worker slots, a queue, and the two ways in (async, thread).

``Sandbox.run`` (from the event loop) and ``Sandbox.run_sync`` (from a thread, e.g. an env's tool
call) run one job each in a free worker slot; at most ``workers`` run at once, the rest wait in
arrival order, at most ``max_waiting`` of them (``SandboxBusy`` past it). A slot holds one job at
a time, when the service is root a host user of its own (locked, so that no other sandbox on the
machine uses it), and where the service can make one a cgroup of its own (``cgroups.py``): a job
starts only after everything the previous one started in that slot is dead.

A job may carry its caller's ``deadline``: past it nobody reads the result, so a job still waiting
for a slot is dropped (TIMEOUT, never started) and a running one is killed (TIMEOUT). Abandoned
calls (a tool call its env stopped waiting for) then never hold a slot that a live call needs.

Never raises for what the code does (that is the :class:`RunResult`); raises
``SandboxUnavailable`` when the sandbox itself cannot run, and ``ValueError`` for a bad request
(a file name with a slash, a bind into /usr, a bind at all in tier ``rlimits-only``, which has no
mount namespace: there a job sees the host's files and network as the service's user does).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from relayrl.common.sandbox.cgroups import Cgroups
from relayrl.common.sandbox.extras import check_binds, check_env
from relayrl.common.sandbox.limits import (
    RunResult,
    SandboxBusy,
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
    Tier,
    Verdict,
)
from relayrl.common.sandbox.packages import default_root, install
from relayrl.common.sandbox.procs import kill_user
from relayrl.common.sandbox.runner import (
    Job,
    Slot,
    check_files,
    resolve_python,
    run_job,
)

logger = logging.getLogger(__name__)


UID_LOCKS = "/run/lock/relayrl-sandbox-users" if os.path.isdir("/run/lock") else "/tmp/relayrl-sandbox-users"
"""Where a root service locks the host users its slots run as (one file per user)."""


class Sandbox:
    """Runs Python programs in the sandbox of ``tier`` (build once per process; probe it with
    ``relayrl.common.sandbox.probe`` before serving)."""

    def __init__(
        self,
        tier: Tier = "full",
        limits: SandboxLimits | None = None,
        workers: int = 2,
        *,
        python: str = "",
        bwrap: str = "bwrap",
        uid_base: int = 61000,
        proc: bool = True,
        cgroups: str = "auto",
        max_waiting: int = 1024,
        packages_dir: str = "",
        packages_timeout: float = 900.0,
    ):
        if tier not in ("full", "rlimits-only"):
            raise ValueError(f"sandbox tier must be 'full' or 'rlimits-only', got {tier!r}")
        if workers < 1:
            raise ValueError("sandbox workers must be at least 1")
        self.tier: Tier = tier
        self.limits = limits or SandboxLimits()
        self.workers = workers
        self.python = resolve_python(python)
        self.proc = proc
        self.packages_dir = Path(packages_dir) if packages_dir else default_root()
        self.packages_timeout = packages_timeout
        self.bwrap = shutil.which(bwrap, path=f"/usr/bin:/bin:{os.environ.get('PATH', '')}") or bwrap
        self._locks: list[int] = []
        uids = self._claim_uids(uid_base, workers) if os.geteuid() == 0 else [None] * workers
        self.uids: list[int] = [u for u in uids if u is not None]
        """Host users of the slots (root only; empty otherwise)."""
        found, self.cgroups = (None, "off (sandbox.cgroups)") if cgroups == "off" else Cgroups.find()
        """How jobs are bounded as a whole: the cgroups found, or why there are none."""
        if found is None and cgroups == "required":
            raise SandboxUnavailable(f"sandbox.cgroups is required and none can be made: {self.cgroups}")
        self.slots = [
            Slot(i, uid, None if found is None else found.make(f"relayrl-sandbox-{_slot_name(i, uid)}"))
            for i, uid in enumerate(uids)
        ]
        self._slots: queue.Queue[Slot] = queue.Queue()
        for slot in self.slots:
            self._slots.put(slot)
        self.max_waiting = max_waiting
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

    @classmethod
    def from_config(cls, config: SandboxConfig) -> Sandbox:
        return cls(
            config.tier, config.limits, config.workers, python=config.python, bwrap=config.bwrap,
            uid_base=config.uid_base, proc=config.proc, cgroups=config.cgroups,
            max_waiting=config.max_waiting, packages_dir=config.packages_dir,
            packages_timeout=config.packages_timeout_seconds,
        )  # fmt: skip

    async def run(
        self,
        code: str,
        stdin: str = "",
        limits: SandboxLimits | None = None,
        files: Mapping[str, str] | None = None,
        *,
        binds: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        deadline: float | None = None,
    ) -> RunResult:
        """Run ``code`` as a Python program (``python3 -I -S -B /tmp/main.py``, cwd /tmp) with
        ``stdin`` and ``files`` written into its /tmp first; waits for a free worker. ``binds``
        (host path -> path inside, read-only; tier ``full`` only) mounts host paths into the job;
        ``env`` adds environment variables to its PATH and HOME (names other than those two).
        ``deadline`` (``time.monotonic()``) is when the caller stops waiting: a job still queued
        then never starts, a running one is killed (both TIMEOUT)."""
        job = self._job(code, stdin, limits, files, binds, env, deadline)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, job)

    def run_sync(
        self,
        code: str,
        stdin: str = "",
        limits: SandboxLimits | None = None,
        files: Mapping[str, str] | None = None,
        *,
        binds: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        deadline: float | None = None,
    ) -> RunResult:
        """``run`` for a thread (blocks it until a worker is free and the job has ended)."""
        return self._run(self._job(code, stdin, limits, files, binds, env, deadline))

    def packages(self, requirements: str) -> str:
        """The read-only folder holding ``requirements`` (a requirements file's text) installed for
        this sandbox's interpreter (``packages.install``: built once, then reused); mount it
        into a job with ``binds``. ``PackagesError`` when pip cannot install them."""
        return str(install(requirements, self.python, self.packages_dir, self.packages_timeout))

    def close(self) -> None:
        """Stop taking async jobs (those running end under their own limits); give the slots'
        users and cgroups back (a cgroup still holding a job's process stays, and is taken over
        by the next sandbox of that slot user)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        for slot in self.slots:
            if slot.cgroup is not None:
                slot.cgroup.remove()
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()

    def _claim_uids(self, base: int, count: int) -> list[int]:
        """``count`` host users from ``base`` up that no other Sandbox on this machine holds (two
        services, two test runs): an exclusive lock per user, held until ``close``. A slot kills
        every process of its user, so no user may serve two sandboxes."""
        os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
        uids: list[int] = []
        for uid in range(base, base + 4096):
            fd = os.open(f"{UID_LOCKS}/{uid}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._locks.append(fd)
            kill_user(uid)  # what a previous holder that died may have left
            uids.append(uid)
            if len(uids) == count:
                return uids
        raise SandboxUnavailable(f"no free sandbox user in {base}..{base + 4095}")

    def _job(
        self,
        code: str,
        stdin: str,
        limits: SandboxLimits | None,
        files: Mapping[str, str] | None,
        binds: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        deadline: float | None = None,
    ) -> Job:
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise ValueError("sandbox code and stdin must be text")
        if binds and self.tier != "full":
            raise ValueError(
                f"sandbox binds need tier full (this sandbox is {self.tier}: no mount namespace)"
            )
        if deadline is not None and not math.isfinite(deadline):
            raise ValueError(f"sandbox deadline must be a finite time.monotonic() value, got {deadline!r}")
        return Job(
            code,
            stdin,
            check_files(files),
            limits or self.limits,
            check_binds(binds),
            check_env(env),
            deadline,
        )

    def _run(self, job: Job) -> RunResult:
        with self._waiting_lock:
            if self._waiting >= self.max_waiting:
                raise SandboxBusy(f"{self._waiting} sandbox jobs wait for a worker (max_waiting)")
            self._waiting += 1
        try:
            wait = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
            slot = self._slots.get(timeout=wait)  # wait: bounded by the caller's deadline
        except queue.Empty:
            return _expired(job)
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        try:
            if job.deadline is not None and time.monotonic() >= job.deadline:
                return _expired(job)
            result, suspect = run_job(
                job, slot, tier=self.tier, bwrap=self.bwrap, python=self.python, proc=self.proc
            )
            if suspect:
                self._confirm_failure(slot, result)
            return result
        finally:
            self._slots.put(slot)

    def _confirm_failure(self, slot: Slot, result: RunResult) -> None:
        """The job ended as bwrap does when it cannot build a sandbox; a trivial job in the same
        slot tells the two apart. Still failing: SandboxUnavailable. Running: the program printed
        it itself, and its result stands (CRASHED, exit code 1)."""
        check = Job("pass", "", {}, SandboxLimits(wall_seconds=5.0))
        again, _ = run_job(check, slot, tier=self.tier, bwrap=self.bwrap, python=self.python, proc=self.proc)
        if again.verdict is not Verdict.OK:
            raise SandboxUnavailable(f"the sandbox does not start: {result.stderr.strip()[:500]}")
        logger.debug("a job printed a bwrap-like failure but the sandbox runs")


def _slot_name(index: int, uid: int | None) -> str:
    """A slot cgroup's name: by its host user (locked, so one sandbox at a time), else unique to
    this process."""
    return f"u{uid}" if uid is not None else f"p{os.getpid()}-{index}"


def _expired(job: Job) -> RunResult:
    """The result of a job whose caller's deadline passed before a worker was free."""
    why = "not started: its caller's deadline passed while it waited for a sandbox worker"
    return RunResult(Verdict.TIMEOUT, None, None, "", why, 0.0, False)
