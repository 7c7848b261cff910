"""A step's training batch from its scored rollout: stale groups dropped, then advantages per
group (GRPO, Dr.GRPO, RLOO) or per token over the whole batch (REINFORCE++, PPO's GAE with the
critic's values and a KL to the reference in the reward); with GAE the critic's samples too
(returns as targets, the values it gave as the centre of its clip)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.advantages import advantages
from relayrl.coordinator.clients import LearnerClient, version_of
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.token_advantages import explained_variance, kl_penalty, token_advantages
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.reward.v1 import reward_pb2 as rw

TOKEN_LEVEL = ("reinforce_pp", "gae")
"""Advantage kinds computed per token over the whole batch (not per group)."""


@dataclass
class TrainBatch:
    """One step's training input: the actor's samples, the critic's (GAE), and batch stats."""

    actor: list[lp.TrainSample]
    critic: list[lp.TrainSample]
    stats: dict[str, float]


async def nothing() -> None:
    return None


@dataclass
class Rollout:
    """One step's scored groups."""

    groups: list[tuple[dict, list[common_pb2.Sample], list[rw.RewardResult]]]
    seconds: dict[str, float] = field(default_factory=dict)
    gen_tokens: int = 0


def train_sample(s: common_pb2.Sample, **advantage) -> lp.TrainSample:
    """The learner's sample for a generated one, with ``advantage`` or ``token_advantages``."""
    return lp.TrainSample(
        prompt_token_ids=s.prompt_token_ids,
        completion_token_ids=s.completion_token_ids,
        generator_logprobs=s.logprobs,
        policy_version=version_of(s),
        **advantage,
    )


def group_batch(
    cfg: ExperimentConfig, version: int, ro: Rollout
) -> tuple[list[lp.TrainSample], list, dict[str, float]]:
    """Stale groups dropped; advantages per group for the GRPO family (groups without signal
    left out); for token-level advantages (REINFORCE++, PPO) the kept (sample, reward) pairs,
    whose advantages come from the whole batch."""
    out, dropped, flat, lags = [], 0, 0, []
    per_batch, kept = cfg.algorithm.advantage in TOKEN_LEVEL, []
    for _row, samples, results in ro.groups:
        lag = max(version - version_of(s) for s in samples)
        if lag > cfg.schedule.max_staleness:
            dropped += 1
            continue
        lags += [version - version_of(s) for s in samples]
        rewards = [r.reward if r.status == rw.SCORE_STATUS_OK else 0.0 for r in results]
        if per_batch:  # advantages come from the whole batch
            kept += [(s, rew) for s, rew in zip(samples, rewards, strict=True)]
            continue
        adv = advantages(rewards, cfg.algorithm.advantage, cfg.algorithm.scale_std)
        if all(a == 0 for a in adv):
            flat += 1  # equal rewards: zero gradient, only cost
            continue
        out += [train_sample(s, advantage=a) for s, a in zip(samples, adv, strict=True)]
    return (
        out,
        kept,
        {
            "dropped_stale_groups": dropped,
            "zero_signal_groups": flat,
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "staleness_max": max(lags, default=0),
        },
    )


async def train_batch(
    cfg: ExperimentConfig,
    version: int,
    ro: Rollout,
    run_id: str,
    critic: LearnerClient | None = None,
    reference: LearnerClient | None = None,
    kl_coef: float = 0.0,
) -> TrainBatch:
    """The step's samples for the actor, and for the critic with GAE: values from ``critic``
    (ComputeValues), the KL in the reward from ``reference``'s log-probs (ComputeLogprobs) with
    coefficient ``kl_coef``."""
    samples, kept, stats = group_batch(cfg, version, ro)
    if not kept:
        return TrainBatch(samples, [], stats)
    a = cfg.algorithm
    seqs = [
        lp.TokenSequence(prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids)
        for s, _ in kept
    ]
    values, ref = await asyncio.gather(
        critic.compute_values(run_id, seqs) if critic else nothing(),
        reference.compute_logprobs(run_id, seqs) if reference else nothing(),
    )
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
        beta=kl_coef,
    )
    actor = [train_sample(s, token_advantages=x.tolist()) for (s, _), x in zip(kept, adv, strict=True)]
    critic = []
    if values is not None:
        critic = [
            lp.TrainSample(
                prompt_token_ids=s.prompt_token_ids,
                completion_token_ids=s.completion_token_ids,
                policy_version=version_of(s),
                returns=r.tolist(),
                values=v,
            )
            for (s, _), r, v in zip(kept, returns, values, strict=True)
        ]
        stats["critic_explained_var"] = explained_variance(values, returns)
        stats["critic_values_mean"] = float(np.mean(np.concatenate([np.asarray(v) for v in values])))
        stats["returns_mean"] = float(np.mean(np.concatenate(returns)))
    if kl is not None:
        stats["kl_reward"] = float(np.mean(np.concatenate(kl)))
        stats["kl_coef"] = kl_coef
    return TrainBatch(actor, critic, stats)
