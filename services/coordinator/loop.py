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
from relayrl.coordinator.algorithms.base import Algorithm, TrainBatch, nothing
from relayrl.coordinator.algorithms.rewards import reward_stats, scored
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.learner import LearnerClient
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.records.alarms import NoSignalAlarm
from relayrl.coordinator.rollout.base import RolloutSource
from relayrl.learner.v1 import learner_pb2 as lp
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


def role_checkpoint_path(run_dir: Path, role: str) -> str:
    """Where a trained learner role beside the actor keeps this run's checkpoints, relative to
    its own ``checkpoint_dir`` (beside the actor's, with the same tags)."""
    return f"{learner_checkpoint_path(run_dir)}/{role}"


def train_metrics(role: str, m: lp.TrainMetrics) -> dict[str, float]:
    """A trained role's metrics beside the actor's, prefixed with its name (its extras too)."""
    out = {f"{role}_loss": m.loss, f"{role}_clip_fraction": m.clip_fraction, f"{role}_grad_norm": m.grad_norm}
    return {**out, **{f"{role}_{k}": v for k, v in m.extra.items()}}


class Experiment:
    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: Path,
        train_rows: list[dict],
        test_rows: list[dict],
        generators: GeneratorPool,
        rollouts: RolloutSource,
        learner: LearnerClient,
        algorithm: Algorithm,
        on_record: Callable[[dict], None] | None = None,
        weights_lock: asyncio.Lock | None = None,
    ):
        """``generators``: the rotation weights are pushed to (``rollouts`` samples from it);
        ``algorithm``: the experiment's family with its learner roles (``algorithms.make``);
        ``weights_lock``: held while the policy version moves (a train step and its
        push), so that a generator readmitted meanwhile is pushed a version that stays current."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.train_rows = train_rows
        self.test_rows = test_rows
        self.gen = generators
        self.rollouts = rollouts
        self.learner = learner
        self.algorithm = algorithm
        # Roles beside the actor that train (a step and a checkpoint each), with their steps done.
        self.trained = {r: self.algorithm.learners[r] for r, t in self.algorithm.roles(cfg).items() if t}
        self.role_steps = dict.fromkeys(self.trained, 0)
        self.pos = Position()
        self.version = 0
        self.saved_step: int | None = None  # the step of the last checkpoint written or loaded
        self.inflight: asyncio.Future | None = None  # the rollout being generated
        self.on_record = on_record
        self.stop_requested = asyncio.Event()
        self.weights_lock = weights_lock or asyncio.Lock()
        self.deadline = cfg.services.deadline_seconds
        self.records: list[dict] = []
        self.no_signal = NoSignalAlarm(cfg.schedule.no_signal_steps, cfg.schedule.no_signal_alarm)

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
    async def evaluate(self) -> float:
        """Held-out accuracy: the share of completions whose answer is correct (one greedy
        completion per row, or ``schedule.eval_samples`` sampled ones), among those the reward
        service scored (a scorer's failure is no wrong answer; too many of them stop the run,
        as in training)."""
        if not self.test_rows:
            return float("nan")
        batch = [(f"test-{i}", row) for i, row in enumerate(self.test_rows)]
        ro = await self.rollouts.rollout(batch, True, f"eval{self.pos.step}", self.version)
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
                # come back later at the weights of that time (clients/rotation.py).
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
        """What a checkpoint keeps of the coordinator: data position and step, the algorithm's
        own state and the steps of the trained roles."""
        steps = {f"{role}_step": n for role, n in self.role_steps.items()}
        return {**asdict(self.pos), **self.algorithm.state(), **steps}

    async def checkpoint(self) -> None:
        """Save the learner (and every trained role) under ``step<N>``, then name that tag in
        ``coordinator.json``. A step that has its checkpoint already is not saved again: the
        learner would overwrite the tag in place while ``coordinator.json`` names it, and a
        crash then would corrupt the only checkpoint a resume can use."""
        if self.saved_step == self.pos.step:
            return
        tag = f"step{self.pos.step}"
        state = json.dumps(self._state())
        await asyncio.gather(
            self.learner.save_checkpoint(learner_checkpoint_path(self.run_dir), tag, state),
            *(
                c.save_checkpoint(role_checkpoint_path(self.run_dir, r), tag, state)
                for r, c in self.trained.items()
            ),
        )
        text = json.dumps({"tag": tag, **self._state()}) + "\n"
        # Readers see the old file or the new one, never half of one (a crash mid-write would
        # leave a run that cannot resume although the learner's tag exists).
        atomic_write(self.run_dir / "checkpoints" / "coordinator.json", lambda tmp: tmp.write_text(text))
        self.saved_step = self.pos.step

    async def resume(self, tag: str, records: list[dict]) -> None:
        """Continue from the checkpoint ``tag``: the learner (and every trained role) load it,
        the data position, policy version, the algorithm's state and metrics come back, and
        fresh generators get the checkpoint's weights."""
        loaded, *roles = await asyncio.gather(
            self.learner.load_checkpoint(learner_checkpoint_path(self.run_dir), tag),
            *(c.load_checkpoint(role_checkpoint_path(self.run_dir, r), tag) for r, c in self.trained.items()),
        )
        state = json.loads(loaded.client_state_json)
        self.pos = Position(state["step"], state["epoch"], state["index"])
        self.algorithm.restore(state)
        self.role_steps = {r: got.step for r, got in zip(self.trained, roles, strict=True)}
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
        tag = f"step{self.pos.step}"  # the step under way when it started
        self.inflight = asyncio.ensure_future(self.rollouts.rollout(batch, False, tag, self.version))
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
        tb = await self.algorithm.batch(self.pos.step, self.version, ro)
        t0 = time.monotonic()
        # wait: a readmission holds it only around a push (a call under a deadline)
        async with self.weights_lock:
            trained = await self._train(tb)
            t1 = time.monotonic()
            sync, synced = await self.push() if tb.actor else (0.0, 0)
        self.algorithm.observe(tb)
        self.pos = Position(self.pos.step + 1, pos_after.epoch, pos_after.index)
        if sched.max_staleness == 0 and not last:
            nxt = self._generate(self.pos)
        values = {
            **reward,
            **ro.stats,
            **tb.stats,
            **trained,
            "policy_version": self.version,
            "train_samples": len(tb.actor),
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
            **self.no_signal.observe(len(tb.actor), reward.get("reward_mean")),
        }
        if sched.eval_every and (self.pos.step % sched.eval_every == 0 or self.pos.step == sched.steps):
            ev = await self.evaluate_alone(self.inflight)
            values["time_idle"] += ev.pop("waited")
            values.update(ev)
        self.record(values, ro.prompt_ids)
        if sched.checkpoint_every and self.pos.step % sched.checkpoint_every == 0:
            await self.checkpoint()
        return nxt

    async def _train(self, tb: TrainBatch) -> dict[str, float]:
        """The actor's train step and every trained role's, together (any may have nothing to
        do); the new policy version and role steps kept; returns their metrics."""
        roles = [(r, samples) for r, samples in tb.roles.items() if samples]
        actor, *answers = await asyncio.gather(
            self.learner.train_step(self.run_dir.name, self.version + 1, tb.actor) if tb.actor else nothing(),
            *(self.trained[r].train_step(self.run_dir.name, self.role_steps[r] + 1, s) for r, s in roles),
        )
        out: dict[str, float] = {}
        if actor is not None:
            self.version = actor.policy_version
            m = actor.metrics
            out = {
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
            # |learner - generator| log-prob of the trained tokens, and of those just after an
            # environment span (multi-turn): where a bridge or template drift shows first.
            out.update(
                {k: m.extra[k] for k in ("logprob_abs_diff", "logprob_abs_diff_after_env") if k in m.extra}
            )
        for (role, _), got in zip(roles, answers, strict=True):
            self.role_steps[role] = got.step
            out.update(train_metrics(role, got.metrics))
        return out
