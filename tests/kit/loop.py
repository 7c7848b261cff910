"""In-process stand-ins of the loop's clients (``GeneratorPool``, ``RewardPool``,
``LearnerClient``), answering like the real services at their contract: every sample of every
prompt with token ids, log-probs and the policy version, a reward per item (the completion's
text read as a number), a policy version per train step. Tests of the loop and of algorithm
families drive ``loop.Experiment`` with them; the engines themselves are tested against vLLM
and DeepSpeed in ``tests/integration``."""

from __future__ import annotations

import asyncio
import json

from relayrl.common.v1 import common_pb2
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.reward.v1 import reward_pb2 as rw


class Generators:
    """GeneratorPool's face: all n samples of every prompt; ``hang`` holds every call from then
    on, ``hang_from`` every call from that one (counted from 1)."""

    def __init__(self):
        self.hang = asyncio.Event()
        self.hang_from = 0
        self.calls = 0
        self.running = 0  # calls under way (a cancelled call leaves)

    def healthy(self):
        return ["gen-0"]

    async def generate(self, prompts, sampling, request_id, min_version=0):
        self.calls += 1
        self.running += 1
        try:
            if self.hang.is_set() or 0 < self.hang_from <= self.calls:
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            return {
                p.prompt_id: [
                    common_pb2.Sample(
                        prompt_id=p.prompt_id,
                        sample_index=i,
                        prompt_token_ids=[1],
                        completion_token_ids=[2, 3],
                        logprobs=[-0.1, -0.2],
                        policy_version=min_version,
                        text=str(i),
                    )
                    for i in range(sampling.n)
                ]
                for p in prompts
            }
        finally:
            self.running -= 1


class Rewards:
    async def score(self, items, request_id):
        return [
            rw.RewardResult(sample_id=x.sample_id, status=rw.SCORE_STATUS_OK, reward=float(x.completion))
            for x in items
        ]


class Learner:
    def __init__(self):
        self.version = 0
        self.saved: list[str] = []  # checkpoint tags
        self.paths: list[str] = []  # where they went
        self.batches: list[list] = []  # samples of every train step
        self.state: dict = {}  # what a loaded checkpoint's client state holds beside the position
        self.hang_train = asyncio.Event()

    async def train_step(self, run_id, step, samples):
        if self.hang_train.is_set():
            await asyncio.Event().wait()
        self.version = step
        self.batches.append(list(samples))
        return lp.TrainStepResponse(step=step, policy_version=step, metrics=lp.TrainMetrics(loss=0.5))

    async def push_weights(self, version):
        return lp.PushWeightsResponse(version=version, replica_ids=["gen-0"])

    async def save_checkpoint(self, path, tag, state):
        self.saved.append(tag)
        self.paths.append(path)
        return lp.SaveCheckpointResponse()

    async def load_checkpoint(self, path, tag):
        step = int(tag.removeprefix("step"))
        state = json.dumps({"step": step, "epoch": 0, "index": 2 * step, **self.state})
        return lp.LoadCheckpointResponse(step=step, policy_version=step, client_state_json=state)
