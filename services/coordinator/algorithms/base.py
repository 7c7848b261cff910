"""The algorithm seam: what an RL algorithm family tells the loop, and nothing else.

A family turns one step's scored rollout into the learners' train batch. It declares the learner
roles it calls beside the actor (PPO's critic, trained in the same step; a frozen reference), so
that the services started and the clients opened follow from it; it checks the experiment's
fields that only it reads; it keeps what it must carry across steps (an adaptive KL coefficient)
in the coordinator's checkpoint. The loop (``loop.Experiment``) only sequences rollout -> batch
-> train -> push -> record -> checkpoint and never branches on an algorithm or a role.

Flows: in, a ``Rollout`` (``rollout/base.py``: groups of samples with their reward results) and the
policy version; out, a ``TrainBatch`` (the actor's samples, the samples of every trained role
beside it, batch statistics for the metrics).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from relayrl.coordinator.clients.learner import LearnerClient
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.rollout.base import Rollout
from relayrl.learner.v1 import learner_pb2 as lp


async def nothing() -> None:
    """A call not made, where ``asyncio.gather`` takes one per role."""
    return None


@dataclass
class TrainBatch:
    """One step's training input. An empty ``actor`` trains no policy step this time (the step
    is recorded, the generators keep their weights): a critic warming up alone, or nothing left
    with signal."""

    actor: list[lp.TrainSample]
    roles: dict[str, list[lp.TrainSample]] = field(default_factory=dict)
    """Samples per trained role beside the actor (``critic``): trained in the same step."""
    stats: dict[str, float] = field(default_factory=dict)


class Algorithm(ABC):
    """One family of algorithms, chosen by ``algorithm.advantage`` (one of ``names``)."""

    names: ClassVar[tuple[str, ...]]
    """The ``algorithm.advantage`` values this family serves."""

    def __init__(self, cfg: ExperimentConfig, learners: Mapping[str, LearnerClient], run_id: str):
        """``learners``: a client per role of ``roles(cfg)``, by role; ``run_id`` goes with
        every call to them (their logs and metrics are per run)."""
        self.cfg = cfg
        self.learners = dict(learners)
        self.run_id = run_id

    @classmethod
    def roles(cls, cfg: ExperimentConfig) -> dict[str, bool]:
        """The learner roles beside the actor this experiment calls, each with whether it
        trains (``critic``: a train step and a checkpoint of its own) or stays frozen
        (``reference``). The experiment's sections of these roles are filled in, others refused."""
        return {}

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        """Refuse fields this family reads (or cannot honour) with a ``ValueError`` whose message
        starts with the field's dotted name. Families that override it call this one too."""
        if cfg.algorithm.critic_warmup and "critic" not in cls.roles(cfg):
            raise ValueError("algorithm.critic_warmup: only algorithm.advantage gae has a critic")

    @abstractmethod
    async def batch(self, step: int, version: int, rollout: Rollout) -> TrainBatch:
        """The train batch of ``rollout`` for the step after ``step`` (steps done), at the
        learner's policy ``version`` (staleness is measured against it)."""

    def observe(self, batch: TrainBatch) -> None:
        """After ``batch`` trained (and its weights were pushed when it had actor samples): move
        what follows the policy (an adaptive controller). Nothing by default."""
        return None

    def state(self) -> dict:
        """What a checkpoint keeps of this family (JSON values); restored by ``restore``."""
        return {}

    def restore(self, state: dict) -> None:
        """Take back what ``state`` returned when the checkpoint was written (keys may be
        missing in checkpoints of older versions: keep the configured values then)."""
        return None
