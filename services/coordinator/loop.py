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
from relayrl.common.data.dataset import atomic_write
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.batch import Rollout, TrainBatch, nothing, reward_stats, scored, train_batch
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
        weights_lock: asyncio.Lock | None = None,
    ):
        """``weights_lock``: held while the policy version moves (a train step and its push), so
        that a generator readmitted meanwhile is pushed a version that stays current."""
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
        self.saved_step: int | None = None  # the step of the last checkpoint written or loaded
        self.inflight: asyncio.Future | None = None  # the rollout being generated
        self.on_record = on_record
        self.stop_requested = asyncio.Event()
        self.weights_lock = weights_lock or asyncio.Lock()
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
        return Rollout(groups, {"generate": t1 - t0, "score": t2 - t1}, tokens, [pid for pid, _ in batch])

    async def train_batch(self, ro: Rollout) -> TrainBatch:
        return await train_batch(
            self.cfg, self.version, ro, self.run_dir.name, self.critic, self.reference, self.kl_coef
        )

    async def evaluate(self) -> float:
        """Held-out accuracy: the share of completions whose answer is correct (one greedy
        completion per row, or ``schedule.eval_samples`` sampled ones), among those the reward
        service scored (a scorer's failure is no wrong answer; too many of them stop the run,
        as in training)."""
        if not self.test_rows:
            return float("nan")
        batch = [(f"test-{i}", row) for i, row in enumerate(self.test_rows)]
        ro = await self.rollout(batch, evaluation=True, tag=f"eval{self.pos.step}")
        done = [r for r, _ in scored(self.cfg, [r for _, _, rs in ro.groups for r in rs])]
        hits = sum(
            r.status == rw.SCORE_STATUS_OK
            and r.components.get("correctness", 1.0 if r.reward >= 1.0 else 0.0) >= 1.0
            for r in done
        )
        return hits / len(done) if done else float("nan")

    async def evaluate_alone(self, pending: asyncio.Future | None) -> dict[str, float]:
        """``evaluate`` once ``pending`` (the batch in flight) has finished generating: the
        evaluation's requests then do not share the generators with it, so its time is its own
        and the batch's generation time stays true. Returns accuracy, the wait and the eval time."""
        t0 = time.monotonic()
        if pending is not None:
            await self.unless_stopped(pending)  # its result or error is taken by the next step
        t1 = time.monotonic()
        evaluation = asyncio.ensure_future(self.evaluate())
        try:
            if not await self.unless_stopped(evaluation):  # a stop skips it: nothing to lose
                return {"waited": t1 - t0}
            return {
                "eval_accuracy": evaluation.result(),
                "waited": t1 - t0,
                "time_eval": time.monotonic() - t1,
            }
        finally:  # stopped, or this task cancelled: never left running behind the run
            if not evaluation.done():
                evaluation.cancel()
                # wait: cancelled just above: it ends at its current await, whose clean-up
                # awaits nothing (a readmission's undo goes to the background: forget_soon)
                await asyncio.gather(evaluation, return_exceptions=True)

    async def unless_stopped(self, work: asyncio.Future) -> bool:
        """Wait for ``work`` unless a stop is requested first. True when ``work`` is done;
        False when the stop came first (``work`` goes on: the caller cancels it or not). Only
        work that changes no state is waited for this way: generation, scoring, evaluation."""
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            # wait: ``work`` ends by itself: each of its calls has a deadline and a number of
            # attempts (services.deadline_seconds, max_attempts, replica_wait_seconds)
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        return work.done()

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
        """Save the learner (and critic) under ``step<N>``, then name that tag in
        ``coordinator.json``. A step that has its checkpoint already is not saved again: the
        learner would overwrite the tag in place while ``coordinator.json`` names it, and a
        crash then would corrupt the only checkpoint a resume can use."""
        if self.saved_step == self.pos.step:
            return
        tag = f"step{self.pos.step}"
        state = json.dumps(self._state())
        await asyncio.gather(
            self.learner.save_checkpoint(learner_checkpoint_path(self.run_dir), tag, state),
            self.critic.save_checkpoint(critic_checkpoint_path(self.run_dir), tag, state)
            if self.critic
            else nothing(),
        )
        text = json.dumps({"tag": tag, **self._state()}) + "\n"
        # Readers see the old file or the new one, never half of one (a crash mid-write would
        # leave a run that cannot resume although the learner's tag exists).
        atomic_write(self.run_dir / "checkpoints" / "coordinator.json", lambda tmp: tmp.write_text(text))
        self.saved_step = self.pos.step

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
        self.saved_step = self.pos.step
        self.records = records
        if self.version:
            await self.push()  # fresh generators hold the initial weights

    def record(self, values: dict, prompt_ids: list[str] | None = None) -> None:
        """Append the step's metrics to ``metrics.jsonl`` and, for a trained step, the prompts
        it consumed to ``ledger.jsonl`` (what shows that a resume loses no prompt and trains
        none twice); both are rewound together on resume."""
        rec = {"step": self.pos.step, "time": time.time(), **values}
        self.records.append(rec)
        if prompt_ids is not None:
            entry = {
                "step": self.pos.step,
                "time": rec["time"],
                "policy_version": self.version,
                "prompts": prompt_ids,
            }
            with open(self.run_dir / "ledger.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.on_record:
            self.on_record(rec)

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Steps until ``schedule.steps`` or a stop. A stop (``stop_requested``) ends the run at
        the next step boundary with a checkpoint: generation and evaluation under way are
        abandoned (they change nothing), a train step under way ends first. A generation
        task left behind by an error is cancelled, never left running."""
        try:
            sched = self.cfg.schedule
            if self.pos.step == 0 and sched.eval_every:
                ev = await self.evaluate_alone(None)
                del ev["waited"]
                if ev:
                    self.record(ev)
            nxt = self._generate(self.pos)
            while self.pos.step < sched.steps and not self.stop_requested.is_set():
                nxt = await self._step(nxt)
        finally:
            if self.inflight is not None and not self.inflight.done():
                self.inflight.cancel()
                # wait: cancelled just above: it ends at its current await, whose clean-up
                # awaits nothing (a readmission's undo goes to the background: forget_soon)
                await asyncio.gather(self.inflight, return_exceptions=True)
        await self.checkpoint()

    def _generate(self, pos: Position) -> Position:
        """Start the rollout of the prompts after ``pos`` (``inflight``); returns where they end."""
        batch, nxt = self.next_prompts(pos)
        self.inflight = asyncio.ensure_future(self.rollout(batch))
        return nxt

    async def _step(self, nxt: Position) -> Position:
        """One step on the rollout ``inflight`` (the prompts up to ``nxt``); returns where the
        prompts of the next rollout under way end. Returns at once, changing nothing, when a
        stop comes while the rollout is still generating."""
        sched = self.cfg.schedule
        # This task's log lines and calls carry the run, the step under way and the policy
        # version (the services log them too: one grep follows a step everywhere).
        logcontext.RUN_ID.set(self.run_dir.name)
        logcontext.STEP.set(str(self.pos.step + 1))
        logcontext.VERSION.set(str(self.version))
        t_wait = time.monotonic()
        if not await self.unless_stopped(self.inflight):
            return nxt
        ro = self.inflight.result()
        idle = time.monotonic() - t_wait
        pos_after = nxt
        last = self.pos.step + 1 >= sched.steps
        reward = reward_stats(self.cfg, ro)
        if sched.max_staleness >= 1 and not last:  # overlap: next batch generates during training
            nxt = self._generate(pos_after)
        t_batch = time.monotonic()
        tb = await self.train_batch(ro)
        samples, stats = tb.actor, tb.stats
        t0 = time.monotonic()
        if tb.critic or self.reference:
            stats["time_values"] = t0 - t_batch  # ComputeValues / ComputeLogprobs
        # The actor waits out the critic's warm-up; the critic trains in the same step.
        if self.pos.step < self.cfg.algorithm.critic_warmup:
            samples = []
        # wait: a readmission holds it only around a push (a call under a deadline)
        async with self.weights_lock:
            train_metrics = await self._train(samples, tb.critic)
            t1 = time.monotonic()
            sync, synced = await self.push() if samples else (0.0, 0)
        # The controller follows the actor's drift: not while the critic warms up alone.
        a = self.cfg.algorithm
        if a.kl_target is not None and "kl_reward" in stats and samples:
            observed = stats["kl_reward" if a.kl_reduction == "token" else "kl_reward_per_sequence"]
            self.kl_coef = adaptive_kl_coef(self.kl_coef, observed, a.kl_target, a.kl_horizon, len(tb.actor))
        self.pos = Position(self.pos.step + 1, pos_after.epoch, pos_after.index)
        if sched.max_staleness == 0 and not last:
            nxt = self._generate(self.pos)
        values = {
            **reward,
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
            ev = await self.evaluate_alone(self.inflight)
            values["time_idle"] += ev.pop("waited")
            values.update(ev)
        self.record(values, ro.prompt_ids)
        if sched.checkpoint_every and self.pos.step % sched.checkpoint_every == 0:
            await self.checkpoint()
        return nxt

    async def _train(self, samples: list, critic_samples: list) -> dict[str, float]:
        """The actor's and the critic's train steps (either may have nothing to do); the new
        policy version and step counts kept; returns their metrics."""
        actor_resp, critic_resp = await asyncio.gather(
            self.learner.train_step(self.run_dir.name, self.version + 1, samples) if samples else nothing(),
            self.critic.train_step(self.run_dir.name, self.critic_step + 1, critic_samples)
            if critic_samples
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
        return train_metrics
