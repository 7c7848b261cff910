"""The token family: per-token advantages over the whole batch. REINFORCE++ (returns-to-go,
whitened over the batch) and PPO with GAE against a critic (a learner of role ``critic``,
trained on the returns in the same step, after ``algorithm.critic_warmup`` steps alone). Either
may put a KL to a frozen reference (a learner of role ``reference``) in the reward, its
coefficient fixed or moved by the adaptive controller and kept in checkpoints. The math is in
``token_advantages`` (pure functions); this module calls the roles and assembles the batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import numpy as np
from relayrl.coordinator.algorithms.base import Algorithm, TrainBatch, nothing
from relayrl.coordinator.algorithms.rewards import fresh_groups
from relayrl.coordinator.algorithms.token_advantages import (
    adaptive_kl_coef,
    explained_variance,
    kl_penalty,
    token_advantages,
)
from relayrl.coordinator.clients.generators import version_of
from relayrl.coordinator.clients.learner import LearnerClient
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.rollout.base import Rollout, train_sample
from relayrl.learner.v1 import learner_pb2 as lp


class TokenFamily(Algorithm):
    names = ("reinforce_pp", "gae")

    def __init__(self, cfg: ExperimentConfig, learners: Mapping[str, LearnerClient], run_id: str):
        super().__init__(cfg, learners, run_id)
        self.kl_coef = cfg.algorithm.kl_coef  # moved by the adaptive controller, checkpointed

    @classmethod
    def roles(cls, cfg: ExperimentConfig) -> dict[str, bool]:
        a = cfg.algorithm
        return {
            **({"critic": True} if a.advantage == "gae" else {}),
            **({"reference": False} if a.kl_coef > 0 else {}),
        }

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        super().check(cfg)
        a = cfg.algorithm
        if a.critic_warmup >= cfg.schedule.steps:
            raise ValueError("algorithm.critic_warmup must be fewer than schedule.steps")
        episodes = getattr(cfg, "episodes", None)
        services = cfg.services
        if episodes is not None and (services.gateway_replicas or services.gateways):
            raise ValueError(
                f"a black-box agent's episode becomes several learner samples where it rewrites its history; "
                f"{a.advantage}'s per-token advantages need one sample per episode: use grpo, drgrpo or rloo"
            )
        if episodes is not None and episodes.turns == "stepwise":
            raise ValueError(
                f"episodes.turns: stepwise makes several learner samples of one episode; {a.advantage}'s "
                "per-token advantages need the episode as one sample (turns: exact), or use grpo, drgrpo or rloo"
            )

    async def batch(self, step: int, version: int, rollout: Rollout) -> TrainBatch:
        """Advantages from every scored sample of the fresh groups together: with GAE the
        critic's values (ComputeValues) as the baseline and its samples (returns as targets, the
        values it gave as the centre of its clip); with a reference its log-probs
        (ComputeLogprobs) for the KL in the reward. While the critic warms up the actor gets no
        samples: it and the generators wait."""
        a = self.cfg.algorithm
        groups, stats = fresh_groups(self.cfg, version, rollout)
        kept = [pair for g in groups for pair in g]
        if not kept:
            return TrainBatch([], stats=stats)
        critic, reference = self.learners.get("critic"), self.learners.get("reference")
        seqs = [
            lp.TokenSequence(prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids)
            for s, _ in kept
        ]
        t0 = time.monotonic()
        values, ref = await asyncio.gather(
            critic.compute_values(self.run_id, seqs) if critic else nothing(),
            reference.compute_logprobs(self.run_id, seqs) if reference else nothing(),
        )
        if critic or reference:
            stats["time_values"] = time.monotonic() - t0
        masks = [rollout.mask(s) for s, _ in kept]
        kl = (
            None
            if ref is None
            else [kl_penalty(s.logprobs, r, a.kl_penalty) for (s, _), r in zip(kept, ref, strict=True)]
        )
        adv, returns = token_advantages(
            [r for _, r in kept],
            [len(s.completion_token_ids) for s, _ in kept],
            a.gamma,
            a.lam,
            values=None if values is None else [np.asarray(v) for v in values],
            kl=kl,
            beta=self.kl_coef,
            masks=masks,
        )
        actor = [
            train_sample(s, m, token_advantages=x.tolist())
            for (s, _), x, m in zip(kept, adv, masks, strict=True)
        ]
        roles = {}
        if values is not None:
            roles["critic"] = [
                lp.TrainSample(
                    prompt_token_ids=s.prompt_token_ids,
                    completion_token_ids=s.completion_token_ids,
                    policy_version=version_of(s),
                    returns=r.tolist(),
                    values=v,
                    loss_mask=m or (),
                )
                for (s, _), r, v, m in zip(kept, returns, values, masks, strict=True)
            ]
            stats["critic_explained_var"] = explained_variance(values, returns)
            stats["critic_values_mean"] = float(np.mean(np.concatenate([np.asarray(v) for v in values])))
            stats["returns_mean"] = float(np.mean(np.concatenate(returns)))
        if kl is not None:
            # Two means of one KL: over every token of the batch, and per completion then over
            # completions (verl's); the adaptive controller follows ``algorithm.kl_reduction``.
            # Only the model's tokens: an environment token's KL is not the policy's drift.
            counted = [k if m is None else k[np.asarray(m) > 0] for k, m in zip(kl, masks, strict=True)]
            stats["kl_reward"] = float(np.mean(np.concatenate(counted)))
            stats["kl_reward_per_sequence"] = float(np.mean([np.mean(k) for k in counted if len(k)]))
            stats["kl_coef"] = self.kl_coef
        if step < a.critic_warmup:
            actor = []
        return TrainBatch(actor, roles, stats)

    def observe(self, batch: TrainBatch) -> None:
        """The adaptive controller follows the actor's drift: not while the critic warms up alone."""
        a = self.cfg.algorithm
        if a.kl_target is not None and "kl_reward" in batch.stats and batch.actor:
            observed = batch.stats["kl_reward" if a.kl_reduction == "token" else "kl_reward_per_sequence"]
            self.kl_coef = adaptive_kl_coef(
                self.kl_coef, observed, a.kl_target, a.kl_horizon, len(batch.actor)
            )

    def state(self) -> dict:
        return {"kl_coef": self.kl_coef}

    def restore(self, state: dict) -> None:
        if self.cfg.algorithm.kl_target is not None:  # a fixed coefficient comes from the config
            self.kl_coef = state.get("kl_coef", self.cfg.algorithm.kl_coef)
