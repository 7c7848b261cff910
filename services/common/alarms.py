"""Streak alarms: a condition that holds step after step (no tool call, no trained sample) means a
run that goes on without learning. Past ``steps`` steps in a row the alarm logs ``ALARM:`` and sets
its metric to 1, or, in ``fail`` mode, raises the owner's failure."""

from __future__ import annotations

import logging
from collections.abc import Callable


class StreakAlarm:
    """Counts steps in a row for which ``observe`` is told the condition holds.

    >>> a = StreakAlarm("alarm_x", 2, "warn", RuntimeError, logging.getLogger("doc"))
    >>> [a.observe(q, str)["alarm_x"] for q in (True, True, False, True, True, True)]
    [0, 1, 0, 0, 1, 1]
    """

    def __init__(self, metric: str, steps: int, mode: str, failure: type[Exception], log: logging.Logger):
        self.metric, self.steps, self.mode, self.failure, self.log = metric, steps, mode, failure, log
        self.streak = 0

    def observe(self, holds: bool, message: Callable[[int], str]) -> dict[str, int]:
        """This step's metric; ``message(streak)`` says what went wrong once the alarm trips."""
        self.streak = self.streak + 1 if holds else 0
        if self.streak < self.steps:
            return {self.metric: 0}
        msg = message(self.streak)
        if self.mode == "fail":
            raise self.failure(msg)
        self.log.warning("ALARM: %s", msg)
        return {self.metric: 1}
