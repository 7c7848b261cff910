"""The trackers a user asked for (``tracking``): every numeric value of every step record, as
TensorBoard scalars in the run folder and/or a Weights & Biases run. Off by default: nothing is
written or sent anywhere unless the experiment turns it on.

Records are what ``metrics.jsonl`` holds (one per step, plus the step-0 evaluation); a resumed run
appends to the same TensorBoard folder (a new event file, read together; steps after the
checkpoint that a crashed run had logged are purged, as they are from ``metrics.jsonl``) and
continues the same W&B run (its id is the run folder's name; W&B keeps the first value it got
for a step, and says so, when a resume logs that step again)."""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from pathlib import Path

from relayrl.coordinator.config import TrackingSection

logger = logging.getLogger(__name__)


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
        self, t: TrackingSection, run_dir: Path, config: dict | None = None, resume_step: int | None = None
    ):
        """``resume_step``: the checkpoint's step when the run resumes (later steps are logged anew)."""
        self.tb = self.wandb = None
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
        values, step = scalars(record), int(record.get("step", 0))
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step, walltime=record.get("time"))
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
