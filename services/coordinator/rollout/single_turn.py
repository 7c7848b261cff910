"""Single-turn samples: the rollout source of experiments without an ``episodes`` section. One
Generate call per batch on the generator rotation (``sampling.n`` completions of each prompt's chat
messages), then one Score call per batch on the reward pool (each completion with its row's data
source and ground truth)."""

from __future__ import annotations

import json
import time

from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.rewards import RewardPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.rollout.base import Rollout
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.reward.v1 import reward_pb2 as rw


def prompt_text(row: dict) -> str:
    return "\n".join(m["content"] for m in row["prompt"])


def ground_truth_text(gt) -> str:
    return gt if isinstance(gt, str) else json.dumps(gt)


class SingleTurn:
    """One completion per sample: the prompt's chat messages to the generators, the completion
    to the reward service with the row's data source and ground truth."""

    def __init__(self, cfg: ExperimentConfig, generators: GeneratorPool, rewards: RewardPool):
        self.cfg = cfg
        self.gen = generators
        self.rewards = rewards

    async def prepare(self) -> None:
        pass

    def sampling(self, evaluation: bool) -> g.SamplingParams:
        s, sched = self.cfg.sampling, self.cfg.schedule
        return g.SamplingParams(
            n=sched.eval_samples if evaluation else s.n,
            max_tokens=s.max_tokens,
            stop=s.stop,
            temperature=sched.eval_temperature if evaluation else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=self.cfg.seed if s.seeded else None,
        )

    async def rollout(
        self, batch: list[tuple[str, dict]], evaluation: bool, tag: str, min_version: int
    ) -> Rollout:
        t0 = time.monotonic()
        prompts = [
            common_pb2.Prompt(
                prompt_id=pid,
                messages=common_pb2.ChatMessages(
                    messages=[
                        common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in row["prompt"]
                    ]
                ),
            )
            for pid, row in batch
        ]
        samples = await self.gen.generate(
            prompts, self.sampling(evaluation), request_id=tag, min_version=min_version
        )
        t1 = time.monotonic()
        items = [
            rw.RewardInput(
                sample_id=f"{pid}/{s.sample_index}",
                prompt=prompt_text(row),
                completion=s.text,
                data_source=row["data_source"],
                ground_truth=ground_truth_text(row["reward_model"]["ground_truth"]),
                extra_info_json=json.dumps(row.get("extra_info") or {}),
            )
            for pid, row in batch
            for s in samples[pid]
        ]
        results = await self.rewards.score(items, request_id=tag)
        t2 = time.monotonic()
        groups, k = [], 0
        for pid, row in batch:
            n = len(samples[pid])
            groups.append((row, samples[pid], results[k : k + n]))
            k += n
        tokens = sum(len(s.completion_token_ids) for v in samples.values() for s in v)
        return Rollout(groups, {"generate": t1 - t0, "score": t2 - t1}, tokens, [pid for pid, _ in batch])
