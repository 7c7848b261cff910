"""The isolation layer: scorers run in K worker processes, one sample at a time, under a timeout.

In flows a batch of :class:`ScoreItem` (``await pool.score(items, timeout)``); out flows one
:class:`SampleResult` per item, in order, each ``ok``, ``error`` (with the message) or ``timeout``.
Nothing a scorer does reaches the server: an exception or a malformed return value becomes
``error``; a scorer still running after ``timeout`` seconds has its process killed (SIGKILL, the
only way to stop a C-level ``9**9**9**9``) and replaced, and the sample becomes ``timeout``; a
process that dies (segfault, OOM kill, ``os._exit``) is replaced too.

Why a pool of our own: ``concurrent.futures.ProcessPoolExecutor`` cannot stop one hung task,
only break the whole pool. Here each worker is a process with a private pipe, driven by one
asyncio task in the server: take the next sample from a shared FIFO, send it, wait for the
pipe to become readable (``loop.add_reader``, no threads) up to the timeout, reply. The timeout
counts from the moment a worker takes the sample, so time spent queued behind other samples
never turns into a TIMEOUT.

Invariants: a worker holds at most one sample; a sample is answered exactly once; the order of
results is the order of items. Samples and results cross the pipe as JSON (plain data both
ways: nothing is unpickled from a request, and a worker's reply cannot run code in the server).

Workers are fresh interpreters (multiprocessing ``spawn``: no state forked from the server's
threads and event loop). Each imports the scorers, math-verify and the plugins
(``module:function``) before it reports ready with the data sources it serves, so no sample pays
for imports; the pool refuses to start when a plugin cannot be loaded. A replacement takes about
a second on a busy machine; only that worker's slot waits for it. Workers ignore SIGINT and
SIGTERM (a signal to the whole process group must not cut the server's drain short) and get
SIGKILL when the server dies, however it dies (Linux ``PR_SET_PDEATHSIG``): a worker stuck in a
scorer never outlives its server. Like every spawn-based pool, a script that starts one must
guard its entry point with ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.rpc import Unavailable
from relayrl.reward import metrics
from relayrl.reward.worker import ERROR, OK, TIMEOUT, PluginError, ScorerInfo, worker_main

__all__ = ["ERROR", "OK", "TIMEOUT", "PluginError", "SampleResult", "ScoreItem", "ScorerInfo", "ScoringPool"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreItem:
    """One sample to score (the servicer builds it from a ``RewardInput``)."""

    data_source: str
    completion: str
    ground_truth: str = ""
    """As sent: text, or JSON text that the worker decodes (``decode_ground_truth``)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt: str = ""
    """Handed to scorers as ``extra_info["prompt"]`` unless extra_info has that key already."""


@dataclass(frozen=True)
class SampleResult:
    status: str
    """``ok``, ``error`` or ``timeout``."""
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0
    """Time the sample spent in a worker (0 when it never reached one)."""


@dataclass
class _Job:
    payload: bytes
    timeout: float
    future: asyncio.Future


@dataclass
class _Worker:
    process: Any
    conn: Any


async def _readable(conn, timeout: float | None) -> None:
    """Wait until ``conn`` has data (or EOF); ``TimeoutError`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
    finally:
        loop.remove_reader(fd)


class ScoringPool:
    """K worker processes scoring samples with a per-sample timeout (see the module docstring)."""

    def __init__(self, workers: int, plugins: Sequence[str] = (), start_timeout: float = 60.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = workers
        self.plugins = list(plugins)
        self.start_timeout = start_timeout
        self.scorers: list[ScorerInfo] = []
        self.restarts = 0
        self._sources: set[str] = set()
        self._ctx = multiprocessing.get_context("spawn")
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._workers: list[_Worker | None] = []
        self._drivers: list[asyncio.Task] = []
        self._procs: set = set()
        """Every worker process started and not reaped yet."""
        self._started = self._closed = False

    @property
    def data_sources(self) -> frozenset[str]:
        """What this pool scores (built-ins and plugins), known once started."""
        return frozenset(self._sources)

    @property
    def live_workers(self) -> int:
        """Workers up now (one being replaced does not count)."""
        return sum(w is not None for w in self._workers)

    # -- lifecycle

    async def start(self) -> None:
        """Start every worker; raises ``PluginError`` when the plugins cannot be loaded."""
        spawned = await asyncio.gather(
            *(self._spawn() for _ in range(self.num_workers)), return_exceptions=True
        )
        self._workers = [w for w in spawned if isinstance(w, _Worker)]
        failed = [e for e in spawned if isinstance(e, BaseException)]
        if failed:
            await self.close()
            raise failed[0]
        self._drivers = [
            asyncio.create_task(self._drive(i), name=f"reward-worker-{i}") for i in range(self.num_workers)
        ]
        self._started = True
        metrics.WORKERS.set(self.num_workers)
        logger.info(
            "%d scoring workers up; data sources: %s", self.num_workers, ", ".join(sorted(self._sources))
        )

    async def close(self) -> None:
        """Stop the drivers and the workers; pending samples fail with UNAVAILABLE."""
        self._closed = True
        for task in self._drivers:
            task.cancel()
        await asyncio.gather(*self._drivers, return_exceptions=True)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(Unavailable("reward service shutting down"))
        for w in self._workers:
            if w is not None:
                try:
                    w.conn.send_bytes(b"null")  # idle workers exit on their own
                except OSError:
                    pass
        await asyncio.gather(*(self._reap(w, grace=1.0) for w in self._workers if w is not None))
        self._workers = []
        for process in list(self._procs):  # none expected: every path reaps what it started
            await self._reap(_Worker(process, None))
        metrics.WORKERS.set(0)

    async def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(child, self.plugins, os.getpid()),
            daemon=True,
            name="relayrl-reward-worker",
        )
        # Started from the event loop's thread, which lives as long as the server: the worker's
        # parent-death signal is tied to the thread that forked it. Fork + exec only: quick.
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._procs.add(process)
        try:
            await _readable(parent, self.start_timeout)
            hello = json.loads(parent.recv_bytes())
            if "fatal" in hello:
                raise PluginError(hello["fatal"])
        except BaseException as e:  # cancelled (shutdown) included: no worker is left behind
            process.kill()
            process.join(5.0)  # quick after SIGKILL
            parent.close()
            self._procs.discard(process)
            if isinstance(e, TimeoutError | EOFError | OSError):
                raise PluginError(
                    f"scoring worker did not start ({type(e).__name__}); plugins {self.plugins}"
                ) from e
            raise
        self.scorers = [ScorerInfo(s, p, o) for s, p, o in hello["scorers"]]
        self._sources = {i.data_source for i in self.scorers}
        return worker

    async def _reap(self, w: _Worker, grace: float = 0.0) -> None:
        """Wait ``grace`` seconds for the process to exit, then kill it; close its pipe."""
        if grace:
            await asyncio.to_thread(w.process.join, grace)
        if w.process.is_alive():
            w.process.kill()
            await asyncio.to_thread(w.process.join, 5.0)
        self._procs.discard(w.process)
        if w.conn is not None:
            w.conn.close()

    async def _replace(self, i: int, reason: str) -> _Worker:
        self.restarts += 1
        metrics.WORKER_RESTARTS.labels(reason).inc()
        old = self._workers[i]
        self._workers[i] = None
        if old is not None:
            await self._reap(old)
        delay = 0.1
        while True:  # a fork that fails now (e.g. out of memory) may work in a moment
            try:
                self._workers[i] = await self._spawn()
                return self._workers[i]
            except Exception:
                logger.exception("cannot replace scoring worker %d; retrying in %.1fs", i, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # -- scoring

    async def score(self, items: Sequence[ScoreItem], timeout: float) -> list[SampleResult]:
        """One result per item, in order. Unknown data sources are ``error`` without a worker."""
        if not self._started or self._closed:
            raise Unavailable("reward workers not running")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        for item in items:
            future = loop.create_future()
            if item.data_source not in self._sources:
                known = ", ".join(sorted(self._sources))
                future.set_result(
                    SampleResult(
                        ERROR, error=f"unknown data_source {item.data_source!r}; this replica scores: {known}"
                    )
                )
            else:
                task = [item.data_source, item.completion, item.ground_truth, item.extra_info, item.prompt]
                self._queue.put_nowait(_Job(json.dumps(task).encode(), timeout, future))
            futures.append(future)
        metrics.QUEUED.set(self._queue.qsize())
        try:
            return list(await asyncio.gather(*futures))
        finally:  # a cancelled call leaves no work behind: drivers skip done futures
            for f in futures:
                f.cancel()

    async def _drive(self, i: int) -> None:
        """Feed worker ``i`` one job at a time, forever; replace it after a timeout or its death."""
        while True:
            job = await self._queue.get()
            metrics.QUEUED.set(self._queue.qsize())
            if job.future.done():  # its caller went away
                continue
            metrics.BUSY.inc()
            try:
                result, replace = await self._run(i, job)
            except Exception as e:  # a bug here must not take the slot down with it
                logger.exception("scoring worker %d failed", i)
                result, replace = (
                    SampleResult(ERROR, error=f"internal error: {type(e).__name__}: {e}"),
                    "internal",
                )
            finally:
                metrics.BUSY.dec()
            if not job.future.done():
                job.future.set_result(result)  # answer first: the caller does not wait for a respawn
            if replace:
                await self._replace(i, replace)

    async def _run(self, i: int, job: _Job) -> tuple[SampleResult, str | None]:
        """Score ``job`` on worker ``i``; also says why the worker must be replaced, if it must."""
        w = self._workers[i]
        if w is None or not w.process.is_alive():
            w = await self._replace(i, "died")
        try:
            w.conn.send_bytes(job.payload)
        except OSError:  # died while idle: the sample never ran, give it a fresh worker
            w = await self._replace(i, "died")
            w.conn.send_bytes(job.payload)
        t0 = time.monotonic()
        try:
            await _readable(w.conn, job.timeout)
            status, reward, components, error = json.loads(w.conn.recv_bytes())
        except TimeoutError:
            w.process.kill()  # free its CPU now; the replacement reaps it
            message = f"scorer ran past {job.timeout:g}s; its worker was replaced"
            return SampleResult(TIMEOUT, error=message, seconds=time.monotonic() - t0), "timeout"
        except (EOFError, OSError):
            await asyncio.to_thread(w.process.join, 1.0)
            message = f"scoring process died (exit code {w.process.exitcode})"
            return SampleResult(ERROR, error=message, seconds=time.monotonic() - t0), "died"
        return SampleResult(status, reward, components, error, time.monotonic() - t0), None
