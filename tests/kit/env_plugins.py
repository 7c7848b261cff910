"""Environment plugins for tests: one with tools that count, misbehave or take their time, envs
whose own code raises or hangs, and a TRL-style class. Loaded as
``tests.kit.env_plugins:<Class>`` by the env service under test."""

from __future__ import annotations

import threading
import time

from relayrl.env.base import Action, Env, Reward, StepAnswer
from relayrl.env.tools import ToolEnv, tool

RUNS: dict[str, int] = {}
"""How many times each tool of ``Tools`` ran, over all sessions (the test's own counter)."""
_lock = threading.Lock()


def _ran(name: str) -> None:
    with _lock:
        RUNS[name] = RUNS.get(name, 0) + 1


class Tools(ToolEnv):
    """Tools that count their runs, refuse, crash, sleep or answer at length."""

    name = "test/tools"
    description = "tools for tests"
    max_turns = 6

    def reset(self, task: dict, seed: int) -> list[dict]:
        return [{"role": "user", "content": f"go (seed {seed})"}]

    @tool
    def bump(self, key: str = "bump") -> str:
        """Count one run under ``key``."""
        _ran(key)
        return f"bumped {key}"

    @tool
    def picky(self, x: int) -> int:
        """Refuse negative numbers.

        Args:
            x: a number, not negative
        """
        if x < 0:
            raise ValueError(f"x must not be negative, got {x}")
        return x

    @tool
    def boom(self) -> str:
        """Always crash."""
        raise RuntimeError("the tool exploded")

    @tool
    def nap(self, seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        _ran("nap")
        return "rested"

    @tool
    def big(self, n: int) -> str:
        """Answer with n characters."""
        return "x" * n

    def reward(self) -> Reward:
        t = self.transcript
        return Reward(float(t.tool_calls), {"turns": float(t.turns)})


class StepRaises(Env):
    name = "test/step_raises"

    def reset(self, task: dict, seed: int) -> list[dict]:
        return [{"role": "user", "content": "hi"}]

    def step(self, action: Action) -> StepAnswer:
        raise RuntimeError("env bug in step")

    def reward(self) -> Reward:
        return Reward(1.0)


class ResetRaises(StepRaises):
    name = "test/reset_raises"

    def reset(self, task: dict, seed: int) -> list[dict]:
        raise KeyError("env bug in reset")


class RewardRaises(Env):
    name = "test/reward_raises"

    def reset(self, task: dict, seed: int) -> list[dict]:
        return [{"role": "user", "content": "hi"}]

    def step(self, action: Action) -> StepAnswer:
        return [], True, []

    def reward(self) -> Reward:
        return Reward(float("nan"))


class StepHangs(StepRaises):
    name = "test/step_hangs"

    def step(self, action: Action) -> StepAnswer:
        time.sleep(1.5)
        return [], True, []


class Masks(RewardRaises):
    name = "test/masks"

    def reward(self) -> Reward:
        return Reward(0.0, {}, "mask", "verifier_failed", "the verifier is down")


class Counter:
    """A counter the model drives with tools (TRL environment_factory style)."""

    def reset(self, **row) -> str:
        self.value = int(row.get("start", 0))
        self.target = int(row["target"])
        return f" Start at {self.value}."

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: how much to add (may be negative)
        """
        self.value += n
        return str(self.value)

    def crash(self) -> str:
        """Divide by zero."""
        return str(1 / 0)

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0
