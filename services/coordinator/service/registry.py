"""Experiments a coordinator runs: their lifecycle (pending -> running -> completed / failed /
stopped), their metrics, and the task that drives each one.

``relayrl run`` puts one experiment in a registry and serves the registry over
``CoordinatorService`` while it runs, so ``relayrl status`` / ``stop`` / ``list`` work against it;
``relayrl serve coordinator`` serves an empty registry that ``StartExperiment`` fills.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from relayrl.common.rpc import AlreadyExists, FailedPrecondition, ResourceExhausted
from relayrl.coordinator import metrics
from relayrl.coordinator.assets import prepare
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.drive import drive
from relayrl.coordinator.errors import RunFailure, describe
from relayrl.coordinator.launch.local import LocalServices
from relayrl.coordinator.launch.service_set import DeployedServices, ServiceSet
from relayrl.coordinator.records.progress import plot
from relayrl.coordinator.records.runfolder import load_records, new_run_dir

logger = logging.getLogger(__name__)

PENDING, RUNNING, STOPPING, COMPLETED, FAILED, STOPPED = (
    "pending",
    "running",
    "stopping",
    "completed",
    "failed",
    "stopped",
)


@dataclass
class Handle:
    run_id: str
    cfg: ExperimentConfig
    run_dir: Path
    state: str = PENDING
    message: str = ""
    started_at: float | None = None
    """When the run went RUNNING (its services up); None while PENDING."""
    records: list[dict] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    stop_timer: asyncio.TimerHandle | None = None  # cancels the run once a stop's grace is over
    cut_short: bool = False  # stopped by cancellation: its last step may have no checkpoint
    step: int = 0
    version: int = 0

    @property
    def finished(self) -> bool:
        return self.state in (COMPLETED, FAILED, STOPPED)

    async def notify(self) -> None:
        # wait: the lock is only ever held without an await in between (here, StreamMetrics)
        async with self.changed:
            self.changed.notify_all()


class Registry:
    def __init__(self, services_factory: Callable | None = None, max_running: int | None = None) -> None:
        """``services_factory(cfg, run_dir)`` builds the ``ServiceSet`` of a run without addresses
        (default ``LocalServices``: local processes; ``relayrl launch ray``: Ray actors).
        ``max_running``: experiments running at once (None: no limit)."""
        self.experiments: dict[str, Handle] = {}
        self.services_factory = services_factory
        self.max_running = max_running

    def get(self, run_id: str) -> Handle | None:
        return self.experiments.get(run_id)

    def newest_first(self) -> list[Handle]:
        """Every experiment, the latest started (or resumed) first."""
        return list(reversed(self.experiments.values()))

    def start(
        self,
        cfg: ExperimentConfig,
        resume_dir: Path | None = None,
        on_record: Callable[[dict], None] | None = None,
        run_id: str = "",
    ) -> Handle:
        """Create the run folder (``run_id`` names it; default ``<name>-<timestamp>``), or reuse
        ``resume_dir``, and start driving the experiment. Raises ``ResourceExhausted`` when
        ``max_running`` experiments run already, ``AlreadyExists`` for a taken ``run_id``.
        Idempotent by ``run_id``: one this registry knows returns its handle, started once and
        counted once, however many starts of it arrive together (nothing here awaits)."""
        if run_id and (known := self.experiments.get(run_id)) is not None:
            return known

        running = sum(not h.finished for h in self.experiments.values())
        if self.max_running is not None and running >= self.max_running:
            raise ResourceExhausted(f"{running} experiments running (max_running {self.max_running})")
        if resume_dir is not None:
            if resume_dir.name in self.experiments and not self.experiments[resume_dir.name].finished:
                raise FailedPrecondition(f"experiment {resume_dir.name} is running; stop it before resuming")
            run_dir = resume_dir
        else:
            try:
                run_dir = new_run_dir(cfg, run_id)
            except FileExistsError:
                raise AlreadyExists(
                    f"run folder {Path(cfg.runs_dir) / run_id} exists; continue it with resume_from"
                ) from None
        handle = Handle(run_id=run_dir.name, cfg=cfg, run_dir=run_dir)
        self.experiments.pop(handle.run_id, None)  # a resumed run lists as the newest
        self.experiments[handle.run_id] = handle
        handle.task = asyncio.ensure_future(self._execute(handle, resume_dir is not None, on_record))
        handle.task.add_done_callback(lambda _task: _stopped_unstarted(handle))
        return handle

    async def _execute(self, h: Handle, resume: bool, on_record) -> None:
        if h.cfg.services.embedded:
            services: ServiceSet = (self.services_factory or LocalServices)(h.cfg, h.run_dir)
        else:
            services = DeployedServices(h.cfg, h.run_dir)

        def record(rec: dict) -> None:
            metrics.observe(h.run_id, rec)
            h.records.append(rec)
            h.step = rec.get("step", h.step)
            h.version = int(rec.get("policy_version", h.version))
            if on_record:
                on_record(rec)
            asyncio.ensure_future(h.notify())

        try:
            if not resume:  # tiny model / data when missing; a stop meanwhile ends the data's
                # generation (it reads the event's flag from its thread: one bool, set once)
                await asyncio.to_thread(prepare, h.cfg, h.stop.is_set)
            if not h.stop.is_set():
                await asyncio.to_thread(services.start)
            if h.stop.is_set():  # stopped while PENDING: it never goes RUNNING nor takes a step
                h.state, h.message = STOPPED, "stopped before its first step"
                return
            h.state = RUNNING
            h.started_at = time.time()
            await h.notify()
            exp = await drive(h.cfg, h.run_dir, services, resume, on_record=record, stop=h.stop)
            # h.records stays this session's list (StreamMetrics readers index into it); the
            # run folder's metrics.jsonl holds the whole run, a resumed one's earlier steps too.
            h.state = STOPPED if h.stop.is_set() and exp.pos.step < h.cfg.schedule.steps else COMPLETED
        except asyncio.CancelledError:
            if not h.stop.is_set():
                raise  # not a stop of this run: the process is going away
            # A second stop, or the grace of the first one passed, ended it where it waited.
            h.state, h.cut_short = STOPPED, True
            saved = (h.run_dir / "checkpoints" / "coordinator.json").exists()
            if h.started_at is None:
                h.message = "stopped before its first step"
            elif saved:
                h.message = "stopped before its step ended; its last checkpoint is where a resume starts"
            else:
                h.message = "stopped before any checkpoint was written"
        except (grpc.aio.AioRpcError, RunFailure) as e:
            why = describe(e)
            resumable = (h.run_dir / "checkpoints" / "coordinator.json").exists()
            h.message = why + (f"; resume with: {services.resume_command} {h.run_dir}" if resumable else "")
            h.state = FAILED
        except (Exception, SystemExit) as e:  # one experiment never ends the coordinator
            logger.exception("experiment %s failed", h.run_id)
            h.message = f"{type(e).__name__}: {e}"
            h.state = FAILED
        finally:
            if h.stop_timer is not None:
                h.stop_timer.cancel()
            await asyncio.to_thread(services.stop)
            try:
                # From the run folder's records: a resumed run's curve starts at step 0, not
                # where this session took over (its own records are only those since).
                plot(h.run_dir, load_records(h.run_dir), h.cfg.schedule.eval_label)
            except Exception:
                logger.warning("reward curve not written", exc_info=True)
            await h.notify()

    def request_stop(self, run_id: str) -> Handle | None:
        """Stop an experiment: at the end of its step, with a checkpoint, within
        ``services.stop_grace_seconds`` (then it is cancelled where it waits); a second request
        cancels it at once. Either way it ends STOPPED and its services are stopped."""
        h = self.experiments.get(run_id)
        if h is None or h.finished:
            return h
        if h.stop.is_set() or h.state == PENDING:  # a second stop, or nothing to save yet: now
            if h.state == PENDING:
                h.state = STOPPING
            h.stop.set()
            h.task.cancel()
            return h
        h.state = STOPPING
        h.stop.set()
        grace = h.cfg.services.stop_grace_seconds
        h.stop_timer = asyncio.get_running_loop().call_later(grace, h.task.cancel)
        return h


def _stopped_unstarted(h: Handle) -> None:
    """A run stopped before its task took its first step never entered ``_execute``: it still
    ends STOPPED (nothing was started, so nothing is stopped)."""
    if not h.finished:
        h.state, h.cut_short, h.message = STOPPED, True, "stopped before its first step"
        asyncio.ensure_future(h.notify())
