"""The trackers a user asked for (``tracking``): every numeric value of every step record, as
TensorBoard scalars in the run folder and/or a Weights & Biases run. Off by default: nothing is
written or sent anywhere unless the experiment turns it on.

Records are what ``metrics.jsonl`` holds (one per step, plus the step-0 evaluation); a resumed run
appends to the same TensorBoard folder (a new event file, read together; steps after the
checkpoint that a crashed run had logged are purged, as they are from ``metrics.jsonl``) and
continues the same W&B run (its id is the run folder's name; W&B keeps the first value it got
for a step, and says so, when a resume logs that step again).

Writes happen off the event loop: ``log`` hands the record's scalars to one background thread (a
bounded queue, records in order) and returns at once, so a slow disk or a W&B server that does
not answer never stalls the run. A tracker that fails fails the run at the next ``log``, as a
synchronous one would have (failing on the last record, it is logged by ``close``, which never
raises: it runs where the run's other clients are being closed). ``close`` flushes and closes within a deadline; past
it the thread is abandoned (a daemon) and what it had not written is said in the log. Trackers
are created (``wandb.init``) synchronously, before the run: a tracker that cannot start fails the
run before it trains."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import queue
import threading
import time
from pathlib import Path

from relayrl.coordinator.config import TrackingSection

logger = logging.getLogger(__name__)

QUEUE_RECORDS = 1000
"""Records waiting for the trackers at most; past it a record is not sent to them (it stays in
``metrics.jsonl``) and a warning says how many were left out: a tracker that far behind would
otherwise hold the run's memory, or, waited for, the run itself."""
CLOSE_TIMEOUT_SECONDS = 60.0
"""How long ``close`` waits for the trackers to write what is queued and finish."""


def missing_packages(t: TrackingSection) -> list[str]:
    """Why the trackers asked for cannot start (a package not installed), checked before a run."""
    out = []
    if t.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        out.append("tracking.tensorboard needs tensorboardX: pip install 'relayrl[coordinator]'")
    if t.wandb is not None and importlib.util.find_spec("wandb") is None:
        out.append("tracking.wandb needs wandb: pip install 'relayrl[wandb]'")
    return out


def scalars(record: dict) -> dict[str, float]:
    """The values a tracker logs: numbers (bools excluded), finite, not the step or the clock.

    >>> scalars({"step": 3, "time": 1.0, "reward_mean": 0.5, "eval_accuracy": float("nan"), "ok": True})
    {'reward_mean': 0.5}
    """
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "time")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class Trackers:
    def __init__(
        self,
        t: TrackingSection,
        run_dir: Path,
        config: dict | None = None,
        resume_step: int | None = None,
        *,
        queue_records: int = QUEUE_RECORDS,
        close_timeout: float = CLOSE_TIMEOUT_SECONDS,
    ):
        """``resume_step``: the checkpoint's step when the run resumes (later steps are logged anew)."""
        self.tb = self.wandb = None
        self.close_timeout = close_timeout
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_records)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._closed = False
        if t.tensorboard:
            from tensorboardX import SummaryWriter

            # Event files are named by the second they start in: a run resumed within the same
            # second would overwrite the earlier file without a suffix of its own.
            self.tb = SummaryWriter(
                str(run_dir / "tensorboard"),
                filename_suffix=f".{time.time_ns()}",
                purge_step=None if resume_step is None else resume_step + 1,
            )
        if t.wandb is not None:
            import wandb

            w = t.wandb
            self.wandb = wandb.init(
                project=w.project,
                entity=w.entity,
                mode=w.mode,
                tags=w.tags or None,
                name=run_dir.name,
                id=run_dir.name,
                resume="allow",
                dir=str(run_dir),
                config=config,
                # The run's own progress line stays as it is: W&B neither captures nor echoes it.
                settings=wandb.Settings(console="off", silent=True),
            )

    def log(self, record: dict) -> None:
        """Queue the record's scalars for the trackers; returns at once (see the module doc).
        Raises what a tracker raised on an earlier record."""
        self._raise_failure()
        if (self.tb is None and self.wandb is None) or self._closed:
            return
        self._start()
        item = (scalars(record), int(record.get("step", 0)), record.get("time"))
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                logger.warning(
                    "trackers are %d records behind: step %d and %d record(s) in all not sent to them "
                    "(metrics.jsonl has them)",
                    self._queue.maxsize,
                    item[1],
                    self.dropped,
                )

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, close the trackers (in their thread), wait at most ``timeout``
        seconds (default ``close_timeout``). Logs a tracker's failure not raised yet; never raises."""
        if self._closed or (self.tb is None and self.wandb is None):
            return
        self._closed = True
        self._start()
        limit = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        try:
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.error(
                "trackers did not finish within %.0fs: up to %d queued record(s) may not have reached "
                "them (metrics.jsonl has every record); left to finish in the background",
                limit,
                self._queue.qsize(),
            )
            return
        if self._error is not None and not self._reported:
            logger.error("a tracker failed: %s (metrics.jsonl has every record)", self.failure)

    @property
    def failure(self) -> str | None:
        """Why the trackers stopped writing (a tracker raised), or None."""
        e = self._error
        return None if e is None else f"{type(e).__name__}: {e}"

    async def aclose(self, timeout: float | None = None) -> None:
        """``close`` in a worker thread, for callers on an event loop."""
        await asyncio.to_thread(self.close, timeout)

    # -- the trackers' thread -----------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="relayrl-trackers", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        """Write records in order until the end mark, then close the trackers. After a failure,
        records are taken and dropped (the caller learns of the failure at its next call)."""
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write(*item)
                except BaseException as e:
                    logger.exception("a tracker failed writing step %d", item[1])
                    self._error = e
        try:
            self._finish()
        except BaseException as e:
            logger.exception("a tracker failed closing")
            self._error = self._error or e

    def _write(self, values: dict[str, float], step: int, walltime: float | None) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step, walltime=walltime)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def _finish(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

    def _raise_failure(self) -> None:
        """Raise a tracker's failure to the caller, once."""
        error = self._error
        if error is not None and not self._reported:
            self._reported = True
            raise RuntimeError(f"a tracker failed: {self.failure}") from error
