"""The RL loop of one experiment: prompts -> Generate -> Score -> advantages -> TrainStep ->
PushWeights, with bounded staleness, evaluation, checkpoints and metrics.

Staleness. Every sample carries the policy version(s) that produced it. With
``max_staleness`` 0 the loop is synchronous: the next batch is generated only after the new
weights reached the generators. With 1 or more, generation of batch k+1 starts before batch k
is trained, so generation overlaps training and weight sync (a swap lands mid-generation and
the affected samples carry both versions). At training time a sample whose oldest version lags
the learner by more than ``max_staleness`` is dropped with its group, and counted.

Timing. Every step records seconds per phase: ``time_generate`` and ``time_score`` (of the batch
trained at this step; with overlap they ran during earlier steps), ``time_train``, ``time_sync``,
and ``time_idle`` (the loop waiting for generation). Evaluation first lets the batch in flight
finish, then runs alone (``time_eval``): it neither slows that batch nor hides generation time,
so a step's wall time minus ``time_eval`` is what training cost.

Data order is a seeded shuffle per epoch; the position (epoch, index) and the step go into
every checkpoint, so a resumed run continues with the same prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from relayrl.common import logcontext
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.batch import Rollout, TrainBatch, nothing, train_batch
from relayrl.coordinator.clients import GeneratorPool, LearnerClient, RewardPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.token_advantages import adaptive_kl_coef
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.reward.v1 import reward_pb2 as rw

logger = logging.getLogger(__name__)
PUSH_ATTEMPTS = 3  # a push that failed because a generator died, tried again without it


@dataclass
class Position:
    """Where the loop is: learner step done and the next prompt's place in the shuffled data."""

    step: int = 0
    epoch: int = 0
    index: int = 0


def learner_checkpoint_path(run_dir: Path) -> str:
    """Where the learner keeps this run's checkpoints, relative to its own ``checkpoint_dir``:
    the learner may run on another host, so the coordinator never sends its own paths."""
    return f"{run_dir.name}/checkpoints"


def critic_checkpoint_path(run_dir: Path) -> str:
    """Where the critic keeps this run's checkpoints, relative to its own ``checkpoint_dir``
    (beside the actor's, with the same tags)."""
    return f"{learner_checkpoint_path(run_dir)}/critic"


def prompt_text(row: dict) -> str:
    return "\n".join(m["content"] for m in row["prompt"])


def ground_truth_text(gt) -> str:
    return gt if isinstance(gt, str) else json.dumps(gt)


class Experiment:
    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: Path,
        train_rows: list[dict],
        test_rows: list[dict],
        generators: GeneratorPool,
        rewards: RewardPool,
        learner: LearnerClient,
        on_record: Callable[[dict], None] | None = None,
        critic: LearnerClient | None = None,
        reference: LearnerClient | None = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.train_rows = train_rows
        self.test_rows = test_rows
        self.gen = generators
        self.rewards = rewards
        self.learner = learner
        self.critic = critic
        self.reference = reference
        self.kl_coef = cfg.algorithm.kl_coef  # moved by the adaptive controller, checkpointed
        self.critic_step = 0
        self.pos = Position()
        self.version = 0
        self.on_record = on_record
        self.stop_requested = asyncio.Event()
        self.deadline = cfg.services.deadline_seconds
        self.records: list[dict] = []

    # -- data ------------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train_rows)))
        if self.cfg.data.shuffle:
            random.Random(self.cfg.seed * 100_003 + epoch).shuffle(order)
        return order

    def next_prompts(self, pos: Position) -> tuple[list[tuple[str, dict]], Position]:
        """The next ``prompts_per_step`` rows with stable ids, and the position after them."""
        out, epoch, index = [], pos.epoch, pos.index
        order = self._order(epoch)
        while len(out) < self.cfg.schedule.prompts_per_step:
            if index >= len(order):
                epoch, index = epoch + 1, 0
                order = self._order(epoch)
            out.append((f"e{epoch}-{order[index]}", self.train_rows[order[index]]))
            index += 1
        return out, Position(pos.step, epoch, index)

    # -- phases ----------------------------------------------------------------------------
    def _sampling(self, evaluation: bool) -> g.SamplingParams:
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
        self, batch: list[tuple[str, dict]], evaluation: bool = False, tag: str = ""
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
            prompts,
            self._sampling(evaluation),
            request_id=tag or f"step{self.pos.step}",
            min_version=self.version,
        )
        t1 = time.monotonic()
        items = []
        for pid, row in batch:
            for s in samples[pid]:
                items.append(
                    rw.RewardInput(
                        sample_id=f"{pid}/{s.sample_index}",
                        prompt=prompt_text(row),
                        completion=s.text,
                        data_source=row["data_source"],
                        ground_truth=ground_truth_text(row["reward_model"]["ground_truth"]),
                        extra_info_json=json.dumps(row.get("extra_info") or {}),
                    )
                )
        results = await self.rewards.score(items, request_id=tag or f"step{self.pos.step}")
        t2 = time.monotonic()
        groups, k = [], 0
        for pid, row in batch:
            n = len(samples[pid])
            groups.append((row, samples[pid], results[k : k + n]))
            k += n
        tokens = sum(len(s.completion_token_ids) for v in samples.values() for s in v)
        return Rollout(groups, {"generate": t1 - t0, "score": t2 - t1}, tokens)

    @staticmethod
    def reward_stats(ro: Rollout) -> dict[str, float]:
        results = [r for _, _, rs in ro.groups for r in rs]
        samples = [s for _, ss, _ in ro.groups for s in ss]
        comps: dict[str, list[float]] = {}
        for r in results:
            for k, v in r.components.items():
                comps.setdefault(k, []).append(v)
        lengths = [len(s.completion_token_ids) for s in samples]
        stats = {
            "reward_mean": sum(r.reward for r in results) / max(1, len(results)),
            "reward_errors": sum(r.status != rw.SCORE_STATUS_OK for r in results),
            "completion_len_mean": sum(lengths) / max(1, len(lengths)),
            "completion_len_max": max(lengths, default=0),
        }
        stats.update({f"reward_{k}": sum(v) / len(v) for k, v in comps.items()})
        return stats

    async def train_batch(self, ro: Rollout) -> TrainBatch:
        return await train_batch(
            self.cfg, self.version, ro, self.run_dir.name, self.critic, self.reference, self.kl_coef
        )

    async def evaluate(self) -> float:
        """Held-out accuracy: the share of completions whose answer is correct (one greedy
        completion per row, or ``schedule.eval_samples`` sampled ones)."""
        if not self.test_rows:
            return float("nan")
        batch = [(f"test-{i}", row) for i, row in enumerate(self.test_rows)]
        ro = await self.rollout(batch, evaluation=True, tag=f"eval{self.pos.step}")
        results = [r for _, _, rs in ro.groups for r in rs]
        hits = sum(
            r.status == rw.SCORE_STATUS_OK
            and r.components.get("correctness", 1.0 if r.reward >= 1.0 else 0.0) >= 1.0
            for r in results
        )
        return hits / max(1, len(results))

    async def evaluate_alone(self, pending: asyncio.Future | None) -> dict[str, float]:
        """``evaluate`` once ``pending`` (the batch in flight) has finished generating: the
        evaluation's requests then do not share the generators with it, so its time is its own
        and the batch's generation time stays true. Returns accuracy, the wait and the eval time."""
        t0 = time.monotonic()
        if pending is not None:
            await asyncio.wait({pending})  # its result or error is taken by the next step
        t1 = time.monotonic()
        accuracy = await self.evaluate()
        return {"eval_accuracy": accuracy, "waited": t1 - t0, "time_eval": time.monotonic() - t1}

    async def push(self) -> tuple[float, int]:
        """New weights to every generator; the learner checks each bucket's checksum on every
        replica (DATA_LOSS otherwise), so a replica listed here holds exactly the learner's
        weights. Returns seconds and the number of replicas updated."""
        t0 = time.monotonic()
        for attempt in range(PUSH_ATTEMPTS):
            try:
                resp = await self.learner.push_weights(self.version)
                break
            except grpc.aio.AioRpcError as e:
                # A generator that dies during a push fails it for every replica (a broadcast
                # group lost a member; the learner's ranks stay in step). The dead leave the
                # rotation and the learner's list, the rest get the weights again, and the dead
                # come back later at the weights of that time (rotation.py).
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == PUSH_ATTEMPTS - 1:
                    raise
                dropped = await self.gen.drop_unserving()
                for rep in self.gen.replicas:  # every one out of rotation: none may hold up a push
                    if not rep.healthy:
                        await self.learner.unregister_generator(rep.name)
                logger.warning(
                    "weight push of version %d failed (%s); out of rotation: %s; pushing again",
                    self.version,
                    e.details(),
                    ", ".join(dropped) or "none",
                )
        return time.monotonic() - t0, len(resp.replica_ids)

    def _state(self) -> dict:
        """What a checkpoint keeps of the coordinator: data position and step, the KL
        controller's coefficient and the critic's step count."""
        return {**asdict(self.pos), "kl_coef": self.kl_coef, "critic_step": self.critic_step}

    async def checkpoint(self) -> None:
        tag = f"step{self.pos.step}"
        state = json.dumps(self._state())
        await asyncio.gather(
            self.learner.save_checkpoint(learner_checkpoint_path(self.run_dir), tag, state),
            self.critic.save_checkpoint(critic_checkpoint_path(self.run_dir), tag, state)
            if self.critic
            else nothing(),
        )
        (self.run_dir / "checkpoints" / "coordinator.json").write_text(
            json.dumps({"tag": tag, **self._state()}) + "\n"
        )

    async def resume(self, tag: str, records: list[dict]) -> None:
        """Continue from the checkpoint ``tag``: the learner (and critic) load it, the data
        position, policy version, KL coefficient and metrics come back, and fresh generators get
        the checkpoint's weights."""
        loaded, critic = await asyncio.gather(
            self.learner.load_checkpoint(learner_checkpoint_path(self.run_dir), tag),
            self.critic.load_checkpoint(critic_checkpoint_path(self.run_dir), tag)
            if self.critic
            else nothing(),
        )
        state = json.loads(loaded.client_state_json)
        self.pos = Position(state["step"], state["epoch"], state["index"])
        if self.cfg.algorithm.kl_target is not None:  # the adaptive controller's own state
            self.kl_coef = state.get("kl_coef", self.cfg.algorithm.kl_coef)
        self.critic_step = critic.step if critic is not None else 0
        self.version = loaded.policy_version
        self.records = records
        if self.version:
            await self.push()  # fresh generators hold the initial weights

    def record(self, values: dict) -> None:
        rec = {"step": self.pos.step, "time": time.time(), **values}
        self.records.append(rec)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.on_record:
            self.on_record(rec)

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        sched = self.cfg.schedule
        if self.pos.step == 0 and sched.eval_every:
            ev = await self.evaluate_alone(None)
            del ev["waited"]
            self.record(ev)
        batch, nxt = self.next_prompts(self.pos)
        pending = asyncio.ensure_future(self.rollout(batch))
        while self.pos.step < sched.steps and not self.stop_requested.is_set():
            # This task's log lines and calls carry the run, the step under way and the policy
            # version (the services log them too: one grep follows a step everywhere).
            logcontext.RUN_ID.set(self.run_dir.name)
            logcontext.STEP.set(str(self.pos.step + 1))
            logcontext.VERSION.set(str(self.version))
            t_wait = time.monotonic()
            ro = await pending
            idle = time.monotonic() - t_wait
            pos_after = nxt
            last = self.pos.step + 1 >= sched.steps
            if sched.max_staleness >= 1 and not last:  # overlap: next batch generates during training
                batch, nxt = self.next_prompts(pos_after)
                pending = asyncio.ensure_future(self.rollout(batch))
            t_batch = time.monotonic()
            tb = await self.train_batch(ro)
            samples, stats = tb.actor, tb.stats
            t0 = time.monotonic()
            if tb.critic or self.reference:
                stats["time_values"] = t0 - t_batch  # ComputeValues / ComputeLogprobs
            # The actor waits out the critic's warm-up; the critic trains in the same step.
            if self.pos.step < self.cfg.algorithm.critic_warmup:
                samples = []
            actor_resp, critic_resp = await asyncio.gather(
                self.learner.train_step(self.run_dir.name, self.version + 1, samples)
                if samples
                else nothing(),
                self.critic.train_step(self.run_dir.name, self.critic_step + 1, tb.critic)
                if tb.critic
                else nothing(),
            )
            train_metrics: dict[str, float] = {}
            if actor_resp is not None:
                self.version = actor_resp.policy_version
                m = actor_resp.metrics
                train_metrics = {
                    "loss": m.loss,
                    "kl": m.kl,
                    "entropy": m.entropy,
                    "clip_fraction": m.clip_fraction,
                    "grad_norm": m.grad_norm,
                    "lr": m.lr,
                    "train_tokens": m.tokens,
                    # rank 0's memory: peak (CUDA allocator, or RSS on CPU) and host RSS now
                    "learner_peak_memory_mb": m.extra.get("peak_memory_mb", float("nan")),
                    "learner_resident_mb": m.extra.get("resident_memory_mb", float("nan")),
                }
            if critic_resp is not None:
                self.critic_step = critic_resp.step
                m = critic_resp.metrics
                train_metrics.update(
                    {
                        "critic_loss": m.loss,
                        "critic_clip_fraction": m.clip_fraction,
                        "critic_grad_norm": m.grad_norm,
                        "critic_vf_mse": m.extra.get("vf_mse", float("nan")),
                    }
                )
            # The controller follows the actor's drift: not while the critic warms up alone.
            if self.cfg.algorithm.kl_target is not None and "kl_reward" in stats and samples:
                a = self.cfg.algorithm
                self.kl_coef = adaptive_kl_coef(
                    self.kl_coef, stats["kl_reward"], a.kl_target, a.kl_horizon, len(tb.actor)
                )
            t1 = time.monotonic()
            sync, synced = await self.push() if samples else (0.0, 0)
            self.pos = Position(self.pos.step + 1, pos_after.epoch, pos_after.index)
            if sched.max_staleness == 0 and not last:
                batch, nxt = self.next_prompts(self.pos)
                pending = asyncio.ensure_future(self.rollout(batch))
            values = {
                **self.reward_stats(ro),
                **stats,
                **train_metrics,
                "policy_version": self.version,
                "train_samples": len(samples),
                "groups": len(ro.groups),
                "synced_replicas": synced,
                "healthy_generators": len(self.gen.healthy()),
                "gen_tokens": ro.gen_tokens,
                "gen_tokens_per_s": ro.gen_tokens / max(1e-9, ro.seconds["generate"]),
                "time_generate": ro.seconds["generate"],
                "time_score": ro.seconds["score"],
                "time_train": t1 - t0,
                "time_sync": sync,
                "time_idle": idle,
            }
            if sched.eval_every and (self.pos.step % sched.eval_every == 0 or self.pos.step == sched.steps):
                ev = await self.evaluate_alone(pending)
                values["time_idle"] += ev.pop("waited")
                values.update(ev)
            self.record(values)
            if sched.checkpoint_every and self.pos.step % sched.checkpoint_every == 0:
                await self.checkpoint()
        if not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await self.checkpoint()
