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
from relayrl.coordinator.errors import ScoringFailed
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
    prompt_ids: list[str] = field(default_factory=list)  # the step's prompts, in data order


def train_sample(s: common_pb2.Sample, **advantage) -> lp.TrainSample:
    """The learner's sample for a generated one, with ``advantage`` or ``token_advantages``."""
    return lp.TrainSample(
        prompt_token_ids=s.prompt_token_ids,
        completion_token_ids=s.completion_token_ids,
        generator_logprobs=s.logprobs,
        policy_version=version_of(s),
        **advantage,
    )


def scored_reward(r: rw.RewardResult, timeout_reward: float | None) -> float | None:
    """The reward a sample trains on, or None when it was not scored: a scorer ERROR always, a
    TIMEOUT unless ``timeout_reward`` says what it counts as (``algorithm.timeout_reward``).

    >>> ok = rw.RewardResult(status=rw.SCORE_STATUS_OK, reward=0.0)
    >>> late = rw.RewardResult(status=rw.SCORE_STATUS_TIMEOUT)
    >>> scored_reward(ok, None), scored_reward(late, None), scored_reward(late, 0.0)
    (0.0, None, 0.0)
    >>> scored_reward(rw.RewardResult(status=rw.SCORE_STATUS_ERROR, reward=0.0), 0.0) is None
    True
    """
    if r.status == rw.SCORE_STATUS_OK:
        return r.reward
    if r.status == rw.SCORE_STATUS_TIMEOUT:
        return timeout_reward
    return None


def scored(cfg: ExperimentConfig, results: list[rw.RewardResult]) -> list[tuple[rw.RewardResult, float]]:
    """The results the reward service scored, with the reward each trains on; raises
    ``ScoringFailed`` when the others are more than ``services.max_reward_error_fraction``."""
    timeout_reward = cfg.algorithm.timeout_reward
    out = [(r, x) for r in results if (x := scored_reward(r, timeout_reward)) is not None]
    limit = cfg.services.max_reward_error_fraction
    if len(results) - len(out) > limit * len(results):
        first = next(r for r in results if scored_reward(r, timeout_reward) is None)
        raise ScoringFailed(
            f"the reward service failed to score {len(results) - len(out)} of {len(results)} samples "
            f"(more than services.max_reward_error_fraction {limit:g}); e.g. "
            f"{rw.ScoreStatus.Name(first.status)} for {first.sample_id}: {first.error[:300]!r}"
        )
    return out


def reward_stats(cfg: ExperimentConfig, ro: Rollout) -> dict[str, float]:
    """Reward means over the samples that were scored (a scorer's failure is no reward of
    0), the failures counted; ``ScoringFailed`` past the bound (``scored``)."""
    results = [r for _, _, rs in ro.groups for r in rs]
    samples = [s for _, ss, _ in ro.groups for s in ss]
    rewards = [x for _, x in scored(cfg, results)]
    comps: dict[str, list[float]] = {}
    for r in results:
        if r.status == rw.SCORE_STATUS_OK:
            for k, v in r.components.items():
                comps.setdefault(k, []).append(v)
    lengths = [len(s.completion_token_ids) for s in samples]
    stats = {
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "reward_errors": sum(r.status == rw.SCORE_STATUS_ERROR for r in results),
        "reward_timeouts": sum(r.status == rw.SCORE_STATUS_TIMEOUT for r in results),
        "completion_len_mean": sum(lengths) / max(1, len(lengths)),
        "completion_len_max": max(lengths, default=0),
    }
    stats.update({f"reward_{k}": sum(v) / len(v) for k, v in comps.items()})
    return stats


def group_batch(
    cfg: ExperimentConfig, version: int, ro: Rollout
) -> tuple[list[lp.TrainSample], list, dict[str, float]]:
    """Stale groups dropped; samples the reward service did not score left out (a group left
    with fewer than 2 gives no signal); advantages per group for the GRPO family (groups without
    signal left out); for token-level advantages (REINFORCE++, PPO) the kept (sample, reward)
    pairs, whose advantages come from the whole batch."""
    out, dropped, flat, lags, unscored, thin = [], 0, 0, [], 0, 0
    per_batch, kept = cfg.algorithm.advantage in TOKEN_LEVEL, []
    for _row, samples, results in ro.groups:
        lag = max(version - version_of(s) for s in samples)
        if lag > cfg.schedule.max_staleness:
            dropped += 1
            continue
        lags += [version - version_of(s) for s in samples]
        rewards = [scored_reward(r, cfg.algorithm.timeout_reward) for r in results]
        scored = [(s, rew) for s, rew in zip(samples, rewards, strict=True) if rew is not None]
        unscored += len(samples) - len(scored)
        if per_batch:  # advantages come from the whole batch
            kept += scored
            continue
        if len(scored) < 2:  # no baseline to compare with
            thin += 1
            continue
        adv = advantages([rew for _, rew in scored], cfg.algorithm.advantage, cfg.algorithm.scale_std)
        if all(a == 0 for a in adv):
            flat += 1  # equal rewards: zero gradient, only cost
            continue
        out += [train_sample(s, advantage=a) for (s, _), a in zip(scored, adv, strict=True)]
    return (
        out,
        kept,
        {
            "dropped_stale_groups": dropped,
            "zero_signal_groups": flat,
            "unscored_samples": unscored,
            "unscored_groups": thin,
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
        # Two means of one KL: over every token of the batch, and per completion then over
        # completions (verl's); the adaptive controller follows ``algorithm.kl_reduction``.
        stats["kl_reward"] = float(np.mean(np.concatenate(kl)))
        stats["kl_reward_per_sequence"] = float(np.mean([np.mean(k) for k in kl if len(k)]))
        stats["kl_coef"] = kl_coef
    return TrainBatch(actor, critic, stats)
