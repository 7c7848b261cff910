"""Algorithm families, one module each, and the registry that picks one by
``algorithm.advantage``. A new family is a module with an ``Algorithm`` subclass (``base.py``
says what it may tell the loop) and one entry in ``FAMILIES``; the loop, the launchers and the
config stay as they are. ``rewards.py`` holds what every family does with a rollout alike (the
rewards that count, the groups fresh enough to train)."""

from __future__ import annotations

from collections.abc import Mapping

from relayrl.coordinator.algorithms.base import Algorithm, TrainBatch
from relayrl.coordinator.algorithms.group import GroupFamily
from relayrl.coordinator.algorithms.token import TokenFamily
from relayrl.coordinator.clients.learner import LearnerClient
from relayrl.coordinator.config import ExperimentConfig

FAMILIES: list[type[Algorithm]] = [GroupFamily, TokenFamily]

__all__ = ["FAMILIES", "Algorithm", "TrainBatch", "check", "family", "make", "names", "roles"]


def names() -> list[str]:
    """Every ``algorithm.advantage`` value a registered family serves."""
    return [n for f in FAMILIES for n in f.names]


def family(cfg: ExperimentConfig) -> type[Algorithm]:
    """The family serving ``cfg.algorithm.advantage``; ValueError naming the field otherwise."""
    name = cfg.algorithm.advantage
    for f in FAMILIES:
        if name in f.names:
            return f
    raise ValueError(f"algorithm.advantage: {name!r} is none of {', '.join(names())}")


def roles(cfg: ExperimentConfig) -> dict[str, bool]:
    """The learner roles beside the actor the experiment's algorithm calls (role -> trains)."""
    return family(cfg).roles(cfg)


def check(cfg: ExperimentConfig) -> None:
    """The algorithm's own checks of the experiment (ValueError naming the field)."""
    family(cfg).check(cfg)


def make(cfg: ExperimentConfig, learners: Mapping[str, LearnerClient], run_id: str) -> Algorithm:
    """The experiment's algorithm, calling ``learners`` (a client per role of ``roles(cfg)``)."""
    return family(cfg)(cfg, learners, run_id)
