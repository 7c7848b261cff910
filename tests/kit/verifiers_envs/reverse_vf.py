"""A verifiers (0.4, ``verifiers.v1``) environment written as its docs write one: a taskset of
digit reversals, worded as relayrl's ``reverse`` task words them (so the tiny reverse model of
the tests answers some right), scored by a reward of its own. No harness: relayrl's chat harness
plays it. Run by relayrl's tests in the sandbox, through the gateway (``env.verifiers``)."""

import random
import re

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversed_digits(self, task: ReverseData, trace: vf.Trace) -> float:
        found = re.search(r"<answer>\s*(.*?)\s*</answer>", trace.last_reply or "", re.S)
        if found is None:
            return 0.0
        return 1.0 if found.group(1) == task.answer else 0.1


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for i in range(64):
            n = str(rng.randint(100, 99999))
            prompt = f"Reverse the digits {n}. Put the answer in <answer> </answer> tags."
            yield ReverseTask(ReverseData(id=f"rev-{i}", prompt=prompt, answer=n[::-1]), self.config.task)


__all__ = ["ReverseTaskset"]
