"""TRL's environment classes and reward functions written as TRL's documentation writes them
(``docs/source/grpo_trainer.md``, "Environments", and ``openenv.md``, trl 1.16), for the env
service to run unchanged: ``env.plugins`` names the class, ``env.reward_funcs`` the functions."""

from __future__ import annotations

import random


class IncrementEnv:
    """The documented example: the model increments a counter to a target; the class scores itself
    (``get_reward``, trl >= 1.9)."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = random.Random(kwargs.get("seed", 0)).randint(1, 6)
        return f"Increment the counter by {self.target}."

    def increment(self, step: int) -> int:
        """
        Increment the counter by a specified value.

        Args:
            step: The value to increment by.

        Returns:
            The new counter value.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)


class GuessEnv:
    """The OpenEnv guide's pattern: a tool per action, the reward kept on the object and read by
    a reward function that receives the environments; a tool raises once the game is over."""

    def reset(self, secret: int, **kwargs) -> str:
        self.secret, self.reward, self.done = secret, 0.0, False
        return " Guess my number (1-9)."

    def guess(self, number: int) -> str:
        """
        Guess the secret number.

        Args:
            number: Your guess.
        """
        if self.done:
            raise ValueError("Game over.")
        if number == self.secret:
            self.reward, self.done = 1.0, True
            return "Correct!"
        return "Higher." if number < self.secret else "Lower."

    @staticmethod
    def helper() -> str:  # a static method is not a tool (TRL lists bound methods only)
        return "no"


def reward_func(environments, **kwargs) -> list[float]:
    return [env.reward for env in environments]


def brevity(completions, secret, **kwargs) -> list[float | None]:
    """A second function, on the dataset's column and the completions: a bonus for few turns; None
    (not applicable) when the row has no secret."""
    return [
        None if s is None else 0.5 / len([m for m in c if m["role"] == "assistant"])
        for c, s in zip(completions, secret, strict=True)
    ]
