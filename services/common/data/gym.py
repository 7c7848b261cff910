"""reasoning-gym tasks as data: ``reasoning_gym/<name>`` (any of its procedural datasets, by name)
written as rows of verl's schema, scored by ``relayrl.reward.gym`` with the task's own
``score_answer``.

A row: the task's question as the user's message after reasoning-gym's default system prompt
(think, then ``<answer>...</answer>``), ``data_source`` the task's name with the prefix, the
answer as ``ground_truth`` and the whole entry (question, answer, metadata) in
``extra_info["entry"]``, which the scorer hands back to reasoning-gym.

Splits are disjoint as the built-in tasks' are: a hash of the question puts each problem in the
test bucket (1 in ``TEST_BUCKETS``) or the train bucket, each split keeps its own, and a call keeps
each question once. The dataset's own parameters (``data.generate.params``) go to its config;
``size`` and ``seed`` are relayrl's. Needs the ``reasoning-gym`` package (``relayrl[tasks]``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

PREFIX = "reasoning_gym/"
TEST_BUCKETS = 10
DRAWS_PER_ROW = 40
"""Most problems drawn per row kept before a task's space is called too small."""
BATCH = 256


def is_gym(task: str) -> bool:
    """A reasoning-gym task name (``reasoning_gym/<name>``)."""
    return task.startswith(PREFIX) and len(task) > len(PREFIX)


def _module():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(
            f"reasoning-gym tasks need the reasoning-gym package (pip install 'relayrl[tasks]'): {e}"
        ) from None
    return reasoning_gym


def names() -> list[str]:
    """Every reasoning-gym dataset name."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check(task: str, params: Mapping[str, Any]) -> None:
    """ValueError unless ``task`` names a reasoning-gym dataset and ``params`` fit its config."""
    name = task[len(PREFIX) :]
    rg = _module()
    if name not in names():
        raise ValueError(f"unknown reasoning-gym task {name!r}; e.g. {', '.join(names()[:8])}, ...")
    if {"size", "seed"} & set(params):
        raise ValueError("size and seed are relayrl's (n_train, n_test, seed), not the task's parameters")
    try:
        rg.create_dataset(name, size=1, seed=0, **params)
    except Exception as e:  # the dataset's config refused a parameter
        raise ValueError(f"reasoning-gym task {name}: {type(e).__name__}: {e}") from None


def _bucket(question: str) -> str:
    h = int.from_bytes(hashlib.blake2b(question.encode(), digest_size=8).digest(), "little")
    return "test" if h % TEST_BUCKETS == 0 else "train"


def rows(task: str, n: int, seed: int, split: str, params: Mapping[str, Any] | None = None) -> list[dict]:
    """``n`` rows of ``split`` of reasoning-gym task ``task``; identical for identical arguments."""
    name = task[len(PREFIX) :]
    check(task, dict(params or {}))
    rg = _module()
    prompt = rg.utils.SYSTEM_PROMPTS["default"]
    out: list[dict] = []
    seen: set[str] = set()
    for round_ in range(max(1, DRAWS_PER_ROW * n // BATCH + 1)):
        if len(out) >= n:
            break
        ds = rg.create_dataset(name, size=BATCH, seed=seed * 1_000_003 + round_, **dict(params or {}))
        for i in range(len(ds)):
            entry = ds[i]
            q = entry["question"]
            if q in seen or _bucket(q) != split:
                continue
            seen.add(q)
            out.append(_row(task, entry, prompt, split, len(out)))
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"{task}: only {len(out)} distinct {split} problems in {DRAWS_PER_ROW * n} draws")
    return out


def _row(task: str, entry: Mapping[str, Any], system: str, split: str, index: int) -> dict:
    answer = entry.get("answer")
    return {
        "data_source": task,
        "prompt": [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
        "extra_info": {"split": split, "index": index, "entry": json.dumps(entry, default=str)},
    }
