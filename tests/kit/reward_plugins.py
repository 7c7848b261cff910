"""Reward plugins for tests: one well-behaved, the others misbehave in each way a plugin can.

Loaded by the scoring workers as ``tests.kit.reward_plugins:<function>``; each function declares the
data sources it scores in ``data_sources``.
"""

from __future__ import annotations

import os
import time

from relayrl.reward.scorers import ScoreResult


def length(completion, ground_truth, extra_info):
    """Reward = completion length; reports the prompt it was given as a component's presence."""
    return ScoreResult(float(len(completion)), {"has_prompt": float("prompt" in extra_info)})


length.data_sources = ["test/length"]


def raises(completion, ground_truth, extra_info):
    raise RuntimeError("plugin exploded")


raises.data_sources = ["test/raise"]


def hangs(completion, ground_truth, extra_info):
    while True:
        time.sleep(1)


hangs.data_sources = ["test/hang"]


def garbage(completion, ground_truth, extra_info):
    return {"reward": float("nan")} if completion == "nan" else "not a number"


garbage.data_sources = ["test/garbage"]


def dies(completion, ground_truth, extra_info):
    os._exit(3)


dies.data_sources = ["test/die"]


def undeclared(completion, ground_truth, extra_info):
    return 1.0
