"""What every algorithm family does with a step's rollout alike: the rewards that count (a
scorer's failure is no reward), the reward statistics, and the groups fresh enough to train. The
families (``group.py``, ``token.py``) turn these into advantages; the loop records the statistics
and measures evaluations with ``scored``."""

from __future__ import annotations

from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.generators import version_of
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.errors import ScoringFailed
from relayrl.coordinator.rollout.base import Rollout
from relayrl.reward.v1 import reward_pb2 as rw


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


def fresh_groups(
    cfg: ExperimentConfig, version: int, ro: Rollout
) -> tuple[list[list[tuple[common_pb2.Sample, float]]], dict[str, float]]:
    """The step's groups as (sample, reward) pairs that may train at policy ``version``: a group
    whose oldest sample lags by more than ``schedule.max_staleness`` dropped whole, a sample the
    reward service did not score left out of its group (``scored_reward``); with the counts."""
    out, dropped, lags, unscored = [], 0, [], 0
    for _row, samples, results in ro.groups:
        lag = max(version - version_of(s) for s in samples)
        if lag > cfg.schedule.max_staleness:
            dropped += 1
            continue
        lags += [version - version_of(s) for s in samples]
        rewards = [scored_reward(r, cfg.algorithm.timeout_reward) for r in results]
        kept = [(s, rew) for s, rew in zip(samples, rewards, strict=True) if rew is not None]
        unscored += len(samples) - len(kept)
        out.append(kept)
    return out, {
        "dropped_stale_groups": dropped,
        "unscored_samples": unscored,
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness_max": max(lags, default=0),
    }
