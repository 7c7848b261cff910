"""Wire one experiment to its services and run the loop: clients of the learner (and the learner
roles its algorithm calls), generators and reward replicas, the algorithm and the rollout
source, generators registered for weight sync, and on resume the learner's checkpoint
loaded and the experiment put back where it stopped."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from relayrl.coordinator import algorithms
from relayrl.coordinator.clients import GeneratorPool, LearnerClient, RewardPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.envs import EnvPool
from relayrl.coordinator.episodes import MultiTurn
from relayrl.coordinator.gateways import GatewayPool
from relayrl.coordinator.loop import Experiment
from relayrl.coordinator.rollouts import SingleTurn
from relayrl.coordinator.runfolder import rewind_records
from relayrl.coordinator.service_set import ServiceSet
from relayrl.coordinator.trackers import Trackers

logger = logging.getLogger(__name__)


async def drive(
    cfg: ExperimentConfig,
    run_dir: Path,
    services: ServiceSet,
    resume: bool,
    on_record=None,
    stop: asyncio.Event | None = None,
) -> Experiment:
    """Run the loop against ``services`` (started already); returns the finished experiment."""
    from relayrl.common.data.dataset import load_rows

    state = json.loads((run_dir / "checkpoints" / "coordinator.json").read_text()) if resume else None
    train_rows = load_rows(cfg.data.train)
    test_rows = load_rows(cfg.data.test) if cfg.data.test else []
    deadline, security = cfg.services.deadline_seconds, cfg.services.security
    learner = LearnerClient(services.learner, deadline, security)
    roles = {r: LearnerClient(services.roles[r], deadline, security, r) for r in algorithms.roles(cfg)}
    wait_s = cfg.services.replica_wait_seconds

    weights_lock = asyncio.Lock()  # held by the loop while the policy version moves
    exp: Experiment | None = None

    async def readmit(name: str, address: str) -> None:
        """A generator serving again after a failure (a restarted container holds the initial
        weights): registered anew, and given the learner's current weights before it samples.
        The registration runs beside training (the learner never holds a train step for it);
        the push waits for a train step and its push under way to end, so the version it names
        is still the learner's when it arrives."""
        reg = await learner.register_generator(name, address)
        try:
            # wait: the loop holds it only around a train step and its push (calls under deadlines)
            async with weights_lock:
                await learner.push_weights(exp.version if exp is not None else reg.policy_version)
        except BaseException:
            # Left registered, a replica that failed again would fail every later push. Not
            # awaited here: the clean-up's own failure would replace the push's error or a
            # cancellation (Ctrl-C); the next push or registration waits for it (_forgotten).
            learner.forget_soon(name)
            raise

    # A dead generator must not fail every later push: the learner forgets it until it is back.
    gens = GeneratorPool(
        services.generators,
        deadline,
        on_down=learner.forget_soon,
        security=security,
        readmit=readmit,
        wait_s=wait_s,
        samples_per_call=cfg.services.generator_samples_per_call,
        max_attempts=cfg.services.max_attempts,
        coming_back=services.coming_back,
    )
    rewards = RewardPool(
        services.rewards,
        deadline,
        security=security,
        wait_s=wait_s,
        max_attempts=cfg.services.max_attempts,
        coming_back=services.coming_back,
    )
    # Opening them may talk to W&B or purge TensorBoard's files: not on the event loop.
    trackers = await asyncio.to_thread(
        Trackers, cfg.tracking, run_dir, cfg.model_dump(mode="json"), state["step"] if state else None
    )

    def record(rec: dict) -> None:
        trackers.log(rec)
        if on_record:
            on_record(rec)

    algorithm = algorithms.make(cfg, roles, run_dir.name)
    envs = (
        EnvPool(services.envs, deadline, security, wait_s, coming_back=services.coming_back)
        if cfg.episodes is not None
        else None
    )
    gateways = (
        GatewayPool(services.gateways, deadline, security, wait_s, coming_back=services.coming_back)
        if services.gateways
        else None
    )
    rollouts = (
        SingleTurn(cfg, gens, rewards)
        if envs is None
        else MultiTurn(cfg, gens, envs, None if resume else run_dir / "episodes" / "first.jsonl", gateways)
    )
    exp = Experiment(
        cfg, run_dir, train_rows, test_rows, gens, rollouts, learner, algorithm, record, weights_lock
    )
    if stop is not None:
        exp.stop_requested = stop
    try:
        for name, addr in services.generators.items():
            await learner.register_generator(name, addr)
        await rollouts.prepare()
        if state is not None:
            rewind_records(run_dir, state["step"], "ledger.jsonl")
            await exp.resume(state["tag"], rewind_records(run_dir, state["step"]))
            print(f"resumed {run_dir.name} at step {exp.pos.step} (policy version {exp.version})", flush=True)
        await exp.run()
    finally:
        await gens.close()
        await rewards.close()
        if envs is not None:
            await envs.close()
        if gateways is not None:
            await gateways.close()
        await trackers.aclose()
        for client in (learner, *roles.values()):
            await client.close()
    return exp
