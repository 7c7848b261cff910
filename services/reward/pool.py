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

Liveness: a worker that cannot be started again (spawn fails, it does not report ready, a plugin
no longer imports) is retried with backoff (0.1 s doubling to 10 s), never given up in silence.
After ``unready_after`` failed starts in a row of one slot, with no worker up, the pool is not
ready: queued samples and new calls fail UNAVAILABLE with the reason (the server's health says
NOT_SERVING), until a worker starts. A slot that keeps failing for ``give_up_seconds`` ends
``died()``: the server exits with status 1 for its supervisor to restart it. What a sample does to
its worker (a timeout, a crash while scoring) is that sample's result, never a failed start: a
request cannot take the replica out. A sample that never reached a scorer (its worker died idle,
twice) fails its call UNAVAILABLE, and a pool fault fails it too: only a scorer's own outcome is
ever a per-sample ERROR or TIMEOUT, whose reward is 0 and is never a score.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.rpc import Unavailable, bounded
from relayrl.reward import metrics
from relayrl.reward.scorers import check_result
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
    tries: int = 0
    """Workers that died before taking it."""


@dataclass
class _Streak:
    """A slot's failed worker starts in a row."""

    failures: int
    since: float
    last: str


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

    def __init__(
        self,
        workers: int,
        plugins: Sequence[str] = (),
        start_timeout: float = 60.0,
        *,
        unready_after: int = 3,
        give_up_seconds: float = 300.0,
        respawn_delays: tuple[float, float] = (0.1, 10.0),
        on_ready: Callable[[bool], object] | None = None,
        sandbox_json: str = "",
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = workers
        self.plugins = list(plugins)
        self.sandbox_json = sandbox_json
        """A ``SandboxConfig`` as JSON: each worker starts and probes its sandbox before it reports
        ready (code rewards); empty: a worker starts a default one on its first code sample."""
        self.start_timeout = start_timeout
        self.unready_after = unready_after
        self.give_up_seconds = give_up_seconds
        self.respawn_delays = respawn_delays
        self.on_ready = on_ready
        """Called with False when the pool stops being able to score, True when it can again."""
        self.unready_reason: str | None = None
        self._streaks: dict[int, _Streak] = {}
        self._fatal: asyncio.Future[str] | None = None
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
        self._fatal = asyncio.get_running_loop().create_future()
        self._drivers = [
            asyncio.create_task(self._drive(i), name=f"reward-worker-{i}") for i in range(self.num_workers)
        ]
        self._started = True
        metrics.WORKERS.set(self.num_workers)
        logger.info(
            "%d scoring workers up; data sources: %s", self.num_workers, ", ".join(sorted(self._sources))
        )

    async def died(self) -> str:
        """Return, with the reason, once a worker slot has failed to start a worker for
        ``give_up_seconds`` (after ``start()``): the process must exit to be restarted
        (``serve_forever(fatal=...)``)."""
        assert self._fatal is not None, "start() first"
        # wait: the server's lifetime: set only when a slot could not start a worker for
        # give_up_seconds (``serve_forever`` races it against SIGTERM)
        return await asyncio.shield(self._fatal)

    async def close(self) -> None:
        """Stop the drivers and the workers; pending samples fail with UNAVAILABLE."""
        self._closed = True
        for task in self._drivers:
            task.cancel()
        # wait: cancelled just above: a driver ends at its current await (a join: at most 5 s)
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
            args=(child, self.plugins, os.getpid(), self.sandbox_json),
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

    async def _replace(self, i: int, reason: str) -> None:
        """Reap worker ``i`` and start another, retrying with backoff until one starts."""
        self.restarts += 1
        metrics.WORKER_RESTARTS.labels(reason).inc()
        old = self._workers[i]
        self._workers[i] = None
        self._update_health()
        if old is not None:
            await self._reap(old)
        first, most = self.respawn_delays
        delay = first
        # wait: until a worker starts (a fork that fails now, e.g. out of memory, may work in a
        # moment); a slot failing for give_up_seconds ends the process (``_update_health``)
        while True:
            try:
                self._workers[i] = await self._spawn()
            except Exception as e:
                self._start_failed(i, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, most)
                continue
            self._streaks.pop(i, None)
            self._update_health()
            return

    # -- liveness (see the module docstring)

    def _start_failed(self, i: int, e: Exception, retry_in: float) -> None:
        s = self._streaks.setdefault(i, _Streak(0, time.monotonic(), ""))
        s.failures += 1
        s.last = bounded(f"{type(e).__name__}: {e}", 300)
        logger.error(
            "scoring worker %d failed to start (%d in a row): %s; retrying in %.1fs",
            i,
            s.failures,
            s.last,
            retry_in,
        )
        self._update_health()

    def _update_health(self) -> None:
        """Readiness from the slots' streaks; fail what waits when it goes; give up past the limit."""
        now = time.monotonic()
        stuck = [(i, s) for i, s in sorted(self._streaks.items()) if s.failures >= self.unready_after]
        reason = None
        if stuck and self.live_workers == 0:
            i, s = stuck[0]
            reason = (
                f"reward replica cannot score: no scoring worker is up and worker {i} failed to start "
                f"{s.failures} times in a row over {now - s.since:.0f}s (last: {s.last})"
            )
        was, self.unready_reason = self.unready_reason, reason
        if (was is None) != (reason is None):
            if reason:
                logger.error("%s", reason)
                self._fail_queued(reason)
            else:
                logger.info("a scoring worker is up again: serving")
            if self.on_ready is not None:
                self.on_ready(reason is None)
        for i, s in stuck:
            if now - s.since >= self.give_up_seconds and self._fatal is not None and not self._fatal.done():
                self._fatal.set_result(
                    f"reward: scoring worker {i} could not be started for {now - s.since:.0f}s "
                    f"({s.failures} tries; last: {s.last})"
                )

    def _fail_queued(self, reason: str) -> None:
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.future.done():
                job.future.set_exception(Unavailable(reason))
        metrics.QUEUED.set(0)

    def _alive(self, i: int) -> bool:
        w = self._workers[i]
        return w is not None and w.process.is_alive()

    # -- scoring

    async def score(self, items: Sequence[ScoreItem], timeout: float) -> list[SampleResult]:
        """One result per item, in order. Unknown data sources are ``error`` without a worker."""
        if not self._started or self._closed:
            raise Unavailable("reward workers not running")
        if self.unready_reason is not None:
            raise Unavailable(self.unready_reason)
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
            # wait: every sample is answered: by a driver within its timeout (max_pending_items
            # caps the queue ahead), or failed when the pool goes unready or closes
            return list(await asyncio.gather(*futures))
        finally:  # a cancelled call leaves no work behind: drivers skip done futures
            for f in futures:
                f.cancel()

    async def _drive(self, i: int) -> None:
        """Feed worker ``i`` one job at a time, forever; replace it after a timeout or its death.
        A slot takes a job only with a live worker, so no job waits on a worker being started."""
        while True:
            if not self._alive(i):
                await self._replace(i, "died")
            # wait: an idle slot waits for work as long as the pool lives; close() cancels it
            job = await self._queue.get()
            metrics.QUEUED.set(self._queue.qsize())
            if job.future.done():  # its caller went away
                continue
            metrics.BUSY.inc()
            try:
                result, replace = await self._run(i, job)
            except asyncio.CancelledError:  # close(): the sample in hand fails as the queued ones do
                if not job.future.done():
                    job.future.set_exception(Unavailable("reward service shutting down"))
                raise
            except Exception as e:  # a bug here must not take the slot down with it
                logger.exception("scoring worker %d failed", i)
                result, replace = e, "internal"
            finally:
                metrics.BUSY.dec()
            if result is None:
                self._retry(job)
            elif not job.future.done():  # answer first: the caller does not wait for a respawn
                if isinstance(result, Exception):  # the pool's fault: no sample result, the call fails
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)
            if replace:
                await self._replace(i, replace)

    def _retry(self, job: _Job) -> None:
        """A job whose worker died before taking it goes back to the queue, once."""
        job.tries += 1
        if job.future.done():
            return
        if job.tries >= 2:
            job.future.set_exception(
                Unavailable("scoring workers died twice before taking the sample; they are being restarted")
            )
        else:
            self._queue.put_nowait(job)

    async def _run(self, i: int, job: _Job) -> tuple[SampleResult | None, str | None]:
        """Score ``job`` on worker ``i``: its result (None when it never reached the worker) and
        why the worker must be replaced, if it must."""
        w = self._workers[i]
        try:
            w.conn.send_bytes(job.payload)
        except OSError:  # died while idle: the sample never ran
            return None, "died"
        t0 = time.monotonic()
        try:
            await _readable(w.conn, job.timeout)
            raw = w.conn.recv_bytes()
        except TimeoutError:
            w.process.kill()  # free its CPU now; the replacement reaps it
            message = f"scorer ran past {job.timeout:g}s; its worker was replaced"
            return SampleResult(TIMEOUT, error=message, seconds=time.monotonic() - t0), "timeout"
        except (EOFError, OSError):
            await asyncio.to_thread(w.process.join, 1.0)
            message = f"scoring process died (exit code {w.process.exitcode})"
            return SampleResult(ERROR, error=message, seconds=time.monotonic() - t0), "died"
        return _reply(raw, time.monotonic() - t0)


def _reply(raw: bytes, seconds: float) -> tuple[SampleResult, str | None]:
    """A worker's answer, checked: only a well-formed OK with a finite reward is a score; anything
    else from the pipe is an ERROR (and a worker that wrote garbage is replaced)."""
    try:
        status, reward, components, error = json.loads(raw)
        if status == OK:
            r = check_result({"reward": reward, "components": components})
            return SampleResult(OK, r.reward, r.components, "", seconds), None
        if status == ERROR and isinstance(error, str):
            return SampleResult(ERROR, error=error, seconds=seconds), None
        raise ValueError(f"status {status!r}")
    except (ValueError, TypeError, RecursionError) as e:
        message = f"scoring worker sent a malformed reply ({bounded(str(e), 200)}); it was replaced"
        return SampleResult(ERROR, error=message, seconds=seconds), "garbage"
