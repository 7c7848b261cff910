"""The coordinator's batch assembly: advantages per group (GRPO family) or per token over the
batch (REINFORCE++), stale groups dropped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.config import AlgorithmSection, ScheduleSection
from relayrl.coordinator.loop import Experiment, Rollout
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


def _train_batch(advantage: str, groups, version: int = 3, **algo):
    cfg = SimpleNamespace(
        algorithm=AlgorithmSection(advantage=advantage, **algo), schedule=ScheduleSection(max_staleness=1)
    )
    return Experiment.train_batch(SimpleNamespace(cfg=cfg, version=version), Rollout(groups))


def test_reinforce_pp_whitens_token_returns_over_the_whole_batch_and_keeps_flat_groups():
    # group A: scores 1, 0 (lengths 2, 1); group B: both 1 (no signal for GRPO, kept here); a stale group
    groups = [_group([1.0, 0.0], [2, 1]), _group([1.0, 1.0], [1, 1]), _group([1.0, 0.0], [1, 1], version=1)]
    out, stats = _train_batch("reinforce_pp", groups)
    assert stats["dropped_stale_groups"] == 1 and stats["zero_signal_groups"] == 0
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
