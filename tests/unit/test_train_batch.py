"""The algorithm families' batch assembly: advantages per group (the group family) or per token
over the batch (the token family: REINFORCE++, PPO's GAE with a critic and a KL to the reference
in the reward), stale groups dropped. The critic and reference are stand-in clients answering fixed numbers: what is tested is
how the coordinator turns them into the actor's and the critic's samples."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest
from relayrl.common.v1 import common_pb2
from relayrl.coordinator import algorithms
from relayrl.coordinator.algorithms.rewards import reward_stats
from relayrl.coordinator.config import AlgorithmSection, ScheduleSection, ServicesSection
from relayrl.coordinator.errors import ScoringFailed
from relayrl.coordinator.rollout.base import Rollout
from relayrl.reward.v1 import reward_pb2 as rw


def _group(rewards: list[float], lengths: list[int], version: int = 3):
    samples = [
        common_pb2.Sample(
            prompt_id="p",
            sample_index=i,
            prompt_token_ids=[1, 2],
            completion_token_ids=list(range(5, 5 + n)),
            logprobs=[-0.5] * n,
            policy_version=version,
        )
        for i, n in enumerate(lengths)
    ]
    results = [rw.RewardResult(reward=r, status=rw.SCORE_STATUS_OK) for r in rewards]
    return ({}, samples, results)


def _cfg(advantage: str, **algo):
    return SimpleNamespace(
        algorithm=AlgorithmSection(advantage=advantage, **algo),
        schedule=ScheduleSection(max_staleness=1),
        services=ServicesSection(),
    )


def _failed(group, index: int, status=rw.SCORE_STATUS_ERROR):
    """``group`` with sample ``index`` unscored (reward 0.0, as a failed result carries)."""
    row, samples, results = group
    results = list(results)
    results[index] = rw.RewardResult(sample_id=f"p/{index}", status=status, reward=0.0, error="boom")
    return row, samples, results


def train_batch(cfg, version, ro, run_id, critic=None, reference=None, kl_coef=None):
    """The batch of ``ro`` from the experiment's family, calling the stand-ins given."""
    roles = {r: c for r, c in (("critic", critic), ("reference", reference)) if c is not None}
    algorithm = algorithms.make(cfg, roles, run_id)
    if kl_coef is not None:
        algorithm.kl_coef = kl_coef
    return algorithm.batch(10, version, ro)


def _train_batch(advantage: str, groups, version: int = 3, **algo):
    tb = asyncio.run(train_batch(_cfg(advantage, **algo), version, Rollout(groups), "run"))
    assert not tb.roles
    return tb.actor, tb.stats


class StandIn:
    """A critic or reference as the coordinator sees it: fixed per-token numbers per call."""

    def __init__(self, per_token: float):
        self.per_token = per_token
        self.calls: list[list] = []

    async def compute_values(self, run_id, sequences):
        self.calls.append(list(sequences))
        return [[self.per_token] * len(s.completion_token_ids) for s in sequences]

    compute_logprobs = compute_values


def test_reinforce_pp_whitens_token_returns_over_the_whole_batch_and_keeps_flat_groups():
    # group A: scores 1, 0 (lengths 2, 1); group B: both 1 (no signal for GRPO, kept here); a stale group
    groups = [_group([1.0, 0.0], [2, 1]), _group([1.0, 1.0], [1, 1]), _group([1.0, 0.0], [1, 1], version=1)]
    out, stats = _train_batch("reinforce_pp", groups)
    assert stats["dropped_stale_groups"] == 1 and "zero_signal_groups" not in stats  # none dropped for it
    # tokens: 1 1 | 0 | 1 | 1 -> mean 0.8, unbiased std sqrt(0.2)
    std = 0.2**0.5
    assert [list(s.token_advantages) for s in out] == [
        pytest.approx([0.2 / std] * 2),
        pytest.approx([-0.8 / std]),
        pytest.approx([0.2 / std]),
        pytest.approx([0.2 / std]),
    ]
    assert all(s.advantage == 0.0 and len(s.token_advantages) == len(s.completion_token_ids) for s in out)


def test_reinforce_pp_discounts_earlier_tokens():
    out, _ = _train_batch("reinforce_pp", [_group([1.0, 0.0], [3, 1])], gamma=0.5)
    first = list(out[0].token_advantages)
    assert first[0] < first[1] < first[2]  # returns 0.25, 0.5, 1 before whitening


def test_grpo_stays_per_sequence_and_leaves_flat_groups_out():
    out, stats = _train_batch("grpo", [_group([1.0, 0.0], [2, 1]), _group([1.0, 1.0], [1, 1])])
    assert stats["zero_signal_groups"] == 1
    assert [round(s.advantage, 4) for s in out] == [1.0, -1.0] and not any(s.token_advantages for s in out)


def test_gae_gives_the_actor_whitened_advantages_and_the_critic_returns_and_its_values():
    critic = StandIn(0.25)
    groups = [_group([1.0, 0.0], [2, 1])]
    tb = asyncio.run(train_batch(_cfg("gae", gamma=1.0, lam=1.0), 3, Rollout(groups), "run", critic=critic))
    assert [len(c) for c in critic.calls] == [2]  # one ComputeValues for the batch
    # lam = gamma = 1: advantages are returns - values: [0.75, 0.75] and [-0.25], then whitened
    raw = np.array([0.75, 0.75, -0.25])
    white = (raw - raw.mean()) / raw.std(ddof=1)
    assert [list(s.token_advantages) for s in tb.actor] == [
        pytest.approx(white[:2]),
        pytest.approx(white[2:]),
    ]
    assert [list(s.returns) for s in tb.roles["critic"]] == [[1.0, 1.0], [0.0]]  # not whitened: value targets
    assert [list(s.values) for s in tb.roles["critic"]] == [[0.25, 0.25], [0.25]]
    assert all(not s.generator_logprobs and not s.token_advantages for s in tb.roles["critic"])
    # returns 1, 1, 0 against values .25: residuals .75, .75, -.25, var 2/9 vs returns' var 2/9
    assert tb.stats["critic_explained_var"] == pytest.approx(
        1 - np.var([0.75, 0.75, -0.25]) / np.var([1, 1, 0])
    )


def test_gae_with_lambda_below_one_trusts_the_critic():
    critic = StandIn(0.5)
    tb = asyncio.run(
        train_batch(
            _cfg("gae", gamma=1.0, lam=0.0), 3, Rollout([_group([1.0, 0.0], [2, 1])]), "run", critic=critic
        )
    )
    # lam 0: A_t = r_t + V_{t+1} - V_t: [0 + .5 - .5, 1 - .5] and [0 - .5]
    raw = np.array([0.0, 0.5, -0.5])
    white = (raw - raw.mean()) / raw.std(ddof=1)
    got = [x for s in tb.actor for x in s.token_advantages]
    assert got == pytest.approx(white)
    assert [list(s.returns) for s in tb.roles["critic"]] == [[0.5, 1.0], [0.0]]  # advantages + values


def test_the_kl_to_the_reference_is_taken_from_every_token_reward():
    # generator log-probs -0.5 (see _group), reference -1.5: k1 = 1 per token, beta 0.1
    ref = StandIn(-1.5)
    tb = asyncio.run(
        train_batch(
            _cfg("reinforce_pp", kl_coef=0.1),
            3,
            Rollout([_group([1.0, 0.0], [2, 1])]),
            "run",
            reference=ref,
            kl_coef=0.1,
        )
    )
    assert tb.stats["kl_reward"] == pytest.approx(1.0) and tb.stats["kl_coef"] == 0.1
    # token rewards [-.1, .9] and [-.1]; returns-to-go [.8, .9] and [-.1], whitened
    raw = np.array([0.8, 0.9, -0.1])
    white = (raw - raw.mean()) / raw.std(ddof=1)
    assert [x for s in tb.actor for x in s.token_advantages] == pytest.approx(white)


def test_explained_variance_is_nan_when_every_return_is_the_same():
    tb = asyncio.run(
        train_batch(_cfg("gae"), 3, Rollout([_group([1.0, 1.0], [1, 1])]), "run", critic=StandIn(0.0))
    )
    assert math.isnan(tb.stats["critic_explained_var"])


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_a_scorer_error_is_left_out_of_its_group_not_trained_as_a_reward_of_0(advantage):
    """An infrastructure failure is no wrong answer: counted as 0 it would be trained on and
    would move every other member's advantage (the baseline)."""
    healthy, _ = _train_batch(advantage, [_group([1.0, 0.5, 0.0], [1, 1, 1])])
    out, stats = _train_batch(advantage, [_failed(_group([1.0, 0.5, 0.0, 0.0], [1, 1, 1, 1]), 3)])
    assert len(out) == 3 and stats["unscored_samples"] == 1
    assert [s.advantage for s in out] == pytest.approx([s.advantage for s in healthy])


def test_a_group_left_with_fewer_than_two_scored_samples_gives_no_signal():
    out, stats = _train_batch("grpo", [_failed(_group([1.0, 0.0], [1, 1]), 1), _group([1.0, 0.0], [1, 1])])
    assert len(out) == 2 and stats["unscored_groups"] == 1 and stats["unscored_samples"] == 1


def test_token_level_advantages_leave_unscored_samples_out_too():
    out, stats = _train_batch("reinforce_pp", [_failed(_group([1.0, 0.0, 1.0], [1, 1, 1]), 2)])
    assert len(out) == 2 and stats["unscored_samples"] == 1


def test_a_timeout_counts_as_the_configured_reward_or_is_left_out():
    group = _failed(_group([1.0, 0.0, 0.0], [1, 1, 1]), 2, rw.SCORE_STATUS_TIMEOUT)
    left_out, stats = _train_batch("drgrpo", [group])
    assert len(left_out) == 2 and stats["unscored_samples"] == 1
    counted, stats = _train_batch("drgrpo", [group], timeout_reward=-1.0)
    assert [s.advantage for s in counted] == pytest.approx([1.0, 0.0, -1.0]) and stats[
        "unscored_samples"
    ] == 0


def test_reward_stats_average_the_scored_samples_and_fail_loud_past_the_error_bound():
    cfg = _cfg("grpo")
    ro = Rollout([_failed(_group([1.0, 1.0, 1.0, 1.0], [1, 1, 1, 1]), 0)])
    stats = reward_stats(cfg, ro)
    assert stats["reward_mean"] == 1.0 and stats["reward_errors"] == 1 and stats["reward_timeouts"] == 0
    many = Rollout([_failed(_failed(_failed(_group([1.0] * 4, [1] * 4), 0), 1), 2)])
    with pytest.raises(ScoringFailed, match=r"3 of 4 samples .* SCORE_STATUS_ERROR for p/0: 'boom'"):
        reward_stats(cfg, many)
    cfg.services = ServicesSection(max_reward_error_fraction=0.75)
    assert reward_stats(cfg, many)["reward_errors"] == 3


def test_the_kl_for_the_adaptive_controller_is_also_averaged_per_sequence():
    """verl's controller averages per completion first: on mixed lengths the two differ."""

    class Ref(StandIn):
        async def compute_logprobs(self, run_id, sequences):  # k1 = 1 on the long one, 0 on the short
            return [
                [-1.5 if len(s.completion_token_ids) == 3 else -0.5] * len(s.completion_token_ids)
                for s in sequences
            ]

    tb = asyncio.run(
        train_batch(_cfg("reinforce_pp"), 3, Rollout([_group([1.0, 0.0], [3, 1])]), "run", reference=Ref(0))
    )
    assert tb.stats["kl_reward"] == pytest.approx(0.75)  # 3 tokens of 1, 1 of 0
    assert tb.stats["kl_reward_per_sequence"] == pytest.approx(0.5)  # (1 + 0) / 2
