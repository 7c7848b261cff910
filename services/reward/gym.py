"""Scoring for reasoning-gym tasks (``relayrl.common.data.gym``): a reward plugin, named in the
reward config as ``relayrl.reward.gym:score``, that scores every ``reasoning_gym/<name>`` data
source with the task's own ``score_answer`` on the answer the completion gives in
``<answer>...</answer>``. Importing it imports reasoning-gym (~1 s, once per reward worker)."""

from __future__ import annotations

import json
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer
from relayrl.common.data.gym import PREFIX
from relayrl.reward.result import ScoreResult


def score(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """The task's score of the completion's ``<answer>`` (0 without one); components
    ``formatted`` (an answer was given) and ``correct`` (a full score)."""
    raw = extra_info.get("entry")
    if not isinstance(raw, str):
        raise ValueError("a reasoning-gym row carries its entry in extra_info['entry'] (JSON)")
    entry = json.loads(raw)
    name = entry["metadata"]["source_dataset"]
    answer = extract_answer(completion)
    value = float(reasoning_gym.get_score_answer_fn(name)(answer, entry)) if answer is not None else 0.0
    return ScoreResult(value, {"formatted": float(answer is not None), "correct": float(value >= 1.0)})


score.data_sources = [PREFIX + name for name in sorted(DATASETS)]
