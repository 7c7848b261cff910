"""A step's scored rollout and what every algorithm family does with it alike: the rewards that
count (a scorer's failure is no reward), the reward statistics, the groups fresh enough to train
and the learner's sample for a generated one. The families (``algorithms/``) turn these into
advantages."""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients import version_of
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.errors import ScoringFailed
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.reward.v1 import reward_pb2 as rw


async def nothing() -> None:
    return None


@dataclass
class Rollout:
    """One step's scored groups."""

    groups: list[tuple[dict, list[common_pb2.Sample], list[rw.RewardResult]]]
    seconds: dict[str, float] = field(default_factory=dict)
    gen_tokens: int = 0
    prompt_ids: list[str] = field(default_factory=list)  # the step's prompts, in data order
    masks: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """Loss masks of samples with tokens the model did not generate (a multi-turn episode's
    environment tokens), by (prompt_id, sample_index); a sample not here trains on every token."""
    stats: dict[str, float] = field(default_factory=dict)
    """Metrics of how the rollout was made (multi-turn: tool calls, turns, redone episodes)."""
    segments: dict[tuple[str, int], list[tuple[common_pb2.Sample, list[float] | None]]] = field(
        default_factory=dict
    )
    """Samples that train as several learner samples, each with its loss mask or None (a
    step-wise episode: one per model call; a black-box episode whose agent rewrote its history:
    one per segment), by (prompt_id, sample_index); the sample in ``groups`` then stands for them
    in the group."""

    def mask(self, s: common_pb2.Sample) -> list[float] | None:
        return self.masks.get((s.prompt_id, s.sample_index))

    def train_samples(self, s: common_pb2.Sample, **advantage) -> list[lp.TrainSample]:
        """The learner's samples for ``s``: one, masked where its tokens are not the model's, or
        one per segment, each with ``s``'s advantage."""
        segments = self.segments.get((s.prompt_id, s.sample_index))
        if segments is not None:
            return [train_sample(seg, mask, **advantage) for seg, mask in segments]
        return [train_sample(s, self.mask(s), **advantage)]


def train_sample(s: common_pb2.Sample, mask: list[float] | None = None, **advantage) -> lp.TrainSample:
    """The learner's sample for a generated one, with ``advantage`` or ``token_advantages``, and
    ``mask`` (``Rollout.mask``) as its loss mask where some of its tokens are not the model's."""
    return lp.TrainSample(
        prompt_token_ids=s.prompt_token_ids,
        completion_token_ids=s.completion_token_ids,
        generator_logprobs=s.logprobs,
        policy_version=version_of(s),
        loss_mask=mask or (),
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
