"""Alarms on a run that goes on but no longer learns: what a metric alone would show only to a
reader who looks.

``NoSignalAlarm``: training steps in a row that trained on no sample. Under group baselines
(GRPO, Dr. GRPO, RLOO) a group whose rewards are all equal carries no signal and is left out, so a
step of such groups trains nothing: the policy collapsed (every answer wrong, often every turn
cut at its token limit: a learning rate too high for the model), the reward never varies (a
verifier that always answers the same), or every episode was masked. Seen on 2026-12-05: a tiny
calc model at lr 2e-4 collapsed at step 4 and the run then spent 26 steps, and exit code 0, on
nothing."""

from __future__ import annotations

import logging

from relayrl.common.alarms import StreakAlarm
from relayrl.coordinator.errors import RunFailure

logger = logging.getLogger(__name__)


class NoTrainingSignal(RunFailure):
    """``schedule.no_signal_alarm: fail`` and too many training steps in a row trained nothing."""


class NoSignalAlarm:
    """Counts training steps in a row without a trained sample; past ``steps``, warns (and sets
    ``alarm_no_signal`` 1 in the metrics) or, with ``fail``, raises ``NoTrainingSignal``.

    >>> a = NoSignalAlarm(2, "warn")
    >>> [a.observe(n, 0.0)["alarm_no_signal"] for n in (0, 0, 5, 0, 0, 0)]
    [0, 1, 0, 0, 1, 1]
    """

    def __init__(self, steps: int, mode: str):
        self.alarm = StreakAlarm("alarm_no_signal", steps, mode, NoTrainingSignal, logger)

    def observe(self, train_samples: int, reward_mean: float | None) -> dict[str, int]:
        mean = "n/a" if reward_mean is None else f"{reward_mean:.3f}"
        return self.alarm.observe(
            not train_samples,
            lambda n: (
                f"no sample trained in {n} training steps in a row (reward_mean {mean}): every group's "
                "rewards were equal or every episode was masked. A collapsed policy (a learning rate too "
                "high for the model: turns cut at their token limit, reward 0), a reward that never "
                "varies, or a broken environment; the policy is not learning"
            ),
        )
