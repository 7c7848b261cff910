"""The rollout seam: what the loop asks for and what it gets back. A ``RolloutSource`` makes the
scored samples of a batch of prompts; a ``Rollout`` holds them (per prompt its samples, with token
ids, log-probs and policy versions, and their reward results, loss masks where some tokens are
not the model's, and how they were made), and gives the learner's samples of each
(``Rollout.train_samples``). The loop does not know how they were made: the sources are
``single_turn``, ``tool_episodes`` and ``agent_episodes``, and ``make`` (this package's
``__init__``) picks one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.generators import version_of
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.reward.v1 import reward_pb2 as rw


class RolloutSource(Protocol):
    async def prepare(self) -> None:
        """Check, before the first rollout, what the services must agree on; raises a
        ``RunFailure`` naming what does not fit."""
        ...

    async def rollout(
        self, batch: list[tuple[str, dict]], evaluation: bool, tag: str, min_version: int
    ) -> Rollout:
        """The scored samples of ``batch`` (prompt id, data row), in its order: ``sampling.n``
        per prompt for training, ``schedule.eval_samples`` with ``evaluation``; every sample
        made by a policy of version ``min_version`` or newer. ``tag`` names the request in the
        services' logs. Raises when they cannot be made (never returns a partial rollout)."""
        ...


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
