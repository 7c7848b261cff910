"""The sandbox a service builds once: worker slots, a queue, and the two ways in (async, thread).

``Sandbox.run`` (from the event loop) and ``Sandbox.run_sync`` (from a thread, e.g. an env's tool
call) run one job each in a free worker slot; at most ``workers`` run at once, the rest wait in
arrival order. A slot holds one job at a time and, when the service is root, a host user of its
own: a job starts only after everything the previous one started in that slot is dead.

Building a Sandbox makes the whole process a child subreaper (``PR_SET_CHILD_SUBREAPER``): each
job's pid 1 is reparented here when bwrap's outer process exits, and reaped by the runner, so no
zombie is left for a container's pid 1 (often the service itself) to collect.

Never raises for what the code does (that is the :class:`RunResult`); raises
``SandboxUnavailable`` when the sandbox itself cannot run, and ``ValueError`` for a bad request
(a file name with a slash).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from relayrl.common.sandbox.limits import (
    RunResult,
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
    Tier,
    Verdict,
)
from relayrl.common.sandbox.runner import Job, Slot, become_subreaper, check_files, resolve_python, run_job

logger = logging.getLogger(__name__)


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
        self.bwrap = shutil.which(bwrap, path=f"/usr/bin:/bin:{os.environ.get('PATH', '')}") or bwrap
        root = os.geteuid() == 0
        become_subreaper()  # bwrap's pid 1 outlives bwrap: it must end here (runner.reap_init)
        self._slots: queue.Queue[Slot] = queue.Queue()
        for i in range(workers):
            self._slots.put(Slot(i, uid_base + i if root else None))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sandbox")

    @classmethod
    def from_config(cls, config: SandboxConfig) -> Sandbox:
        return cls(
            config.tier, config.limits, config.workers, python=config.python, bwrap=config.bwrap,
            uid_base=config.uid_base, proc=config.proc,
        )  # fmt: skip

    async def run(
        self,
        code: str,
        stdin: str = "",
        limits: SandboxLimits | None = None,
        files: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run ``code`` as a Python program (``python3 -I -S -B /tmp/main.py``, cwd /tmp) with
        ``stdin`` and ``files`` written into its /tmp first; waits for a free worker."""
        job = self._job(code, stdin, limits, files)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, job)

    def run_sync(
        self,
        code: str,
        stdin: str = "",
        limits: SandboxLimits | None = None,
        files: Mapping[str, str] | None = None,
    ) -> RunResult:
        """``run`` for a thread (blocks it until a worker is free and the job has ended)."""
        return self._run(self._job(code, stdin, limits, files))

    def close(self) -> None:
        """Stop taking async jobs (those running end under their own limits)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _job(
        self, code: str, stdin: str, limits: SandboxLimits | None, files: Mapping[str, str] | None
    ) -> Job:
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise ValueError("sandbox code and stdin must be text")
        return Job(code, stdin, check_files(files), limits or self.limits)

    def _run(self, job: Job) -> RunResult:
        slot = self._slots.get()
        try:
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
