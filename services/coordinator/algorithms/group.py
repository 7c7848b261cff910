"""The group family (GRPO, Dr.GRPO, RLOO; DAPO's and GSPO's losses are the learner's
``learner.loss`` options on these advantages): one advantage per sample from its prompt's group
of ``sampling.n``, no learner role beside the actor. A KL to a reference, if any, lives in the
actor's loss (``learner.loss.kl_coef``, its reference in-process), not in the reward."""

from __future__ import annotations

from relayrl.coordinator.algorithms.advantages import advantages
from relayrl.coordinator.algorithms.base import Algorithm, TrainBatch
from relayrl.coordinator.algorithms.rewards import fresh_groups
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.rollout.base import Rollout


class GroupFamily(Algorithm):
    names = ("grpo", "drgrpo", "rloo")

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        if cfg.algorithm.kl_coef > 0:
            raise ValueError(
                "algorithm.kl_coef: a KL in the reward needs token-level advantages (reinforce_pp or gae); "
                "for group advantages put the KL in the loss (learner.loss.kl_coef)"
            )

    async def batch(self, step: int, version: int, rollout: Rollout) -> TrainBatch:
        """Advantages per group; a group left with fewer than 2 scored samples has no baseline,
        one whose rewards are all equal no gradient: both left out, and counted."""
        a = self.cfg.algorithm
        groups, stats = fresh_groups(self.cfg, version, rollout)
        out, thin, flat = [], 0, 0
        for scored in groups:
            if len(scored) < 2:
                thin += 1
                continue
            adv = advantages([rew for _, rew in scored], a.advantage, a.scale_std)
            if all(x == 0 for x in adv):
                flat += 1  # equal rewards: zero gradient, only cost
                continue
            out += [
                t
                for (s, _), x in zip(scored, adv, strict=True)
                for t in rollout.train_samples(s, advantage=x)
            ]
        return TrainBatch(out, stats={**stats, "zero_signal_groups": flat, "unscored_groups": thin})
