"""Built-in env ``guess``: find a hidden whole number from 1 to 63 in at most 8 turns.

The hidden number is the task's ``reward_model.ground_truth`` when it has one, else derived from
the seed and the task (the same seed and task give the same number on any replica). The model
writes ``<guess>N</guess>`` (the last such tag of a turn counts); the env answers with a "user"
message: "higher" (the number is higher), "lower" or, for a turn without a guess, "error: write
<guess>N</guess>". A right guess ends the episode. Reward: 1 - 0.1 * (turns - 1) when found,
else 0; components ``correctness`` and ``turns``. No tools: calls are answered UNKNOWN_TOOL.
"""

from __future__ import annotations

import hashlib
import json
import re

from relayrl.env.base import Action, Env, Reward, StepAnswer, TaskError, prompt_messages
from relayrl.env.tools import refuse_tools

LOW, HIGH = 1, 63
_GUESS = re.compile(r"<guess>\s*(-?\d{1,6})\s*</guess>")


def hidden_number(task: dict, seed: int) -> int:
    """The number to find: the task's ground truth, else one from (seed, task).

    >>> hidden_number({"reward_model": {"ground_truth": "17"}}, 0)
    17
    >>> hidden_number({"prompt": "x"}, 1) == hidden_number({"prompt": "x"}, 1)
    True
    """
    gt = (task.get("reward_model") or {}).get("ground_truth")
    if gt not in (None, ""):
        try:
            n = int(str(gt).strip())
        except ValueError:
            raise TaskError(f"guess: ground_truth {gt!r:.40} is not a whole number") from None
        if not LOW <= n <= HIGH:
            raise TaskError(f"guess: ground_truth {n} is not in {LOW}..{HIGH}")
        return n
    key = f"{seed}\n{json.dumps(task, sort_keys=True, default=str)}".encode()
    return LOW + int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % (HIGH - LOW + 1)


class GuessEnv(Env):
    name = "guess"
    description = f"Find a hidden number in {LOW}..{HIGH} with <guess>N</guess>; told higher or lower."
    max_turns = 8
    SYSTEM = (
        f"I am thinking of a whole number from {LOW} to {HIGH}. Write one guess per turn as "
        "<guess>N</guess>; I will answer higher, lower or correct."
    )

    def reset(self, task: dict, seed: int) -> list[dict]:
        self.hidden = hidden_number(task, seed)
        self.turns, self.found = 0, False
        prompt = prompt_messages(task) if task.get("prompt") else [{"role": "user", "content": "Your guess?"}]
        return [{"role": "system", "content": self.SYSTEM}, *prompt]

    def step(self, action: Action) -> StepAnswer:
        self.turns += 1
        messages, results = refuse_tools(action.tool_calls)
        guesses = _GUESS.findall(action.text)
        if not guesses:
            reply = "error: write <guess>N</guess>"
        else:
            n = int(guesses[-1])
            self.found = n == self.hidden
            reply = "correct" if self.found else "higher" if self.hidden > n else "lower"
        done = self.found or self.turns >= self.max_turns
        return ([] if done else [*messages, {"role": "user", "content": reply}]), done, results

    def reward(self) -> Reward:
        r = max(0.0, 1.0 - 0.1 * (self.turns - 1)) if self.found else 0.0
        return Reward(r, {"correctness": float(self.found), "turns": float(self.turns)})
