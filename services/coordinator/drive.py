"""Wire one experiment to its services and run the loop: clients of the learner, generators and
reward replicas, generators registered for weight sync, and on resume the learner's checkpoint
loaded and the experiment put back where it stopped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from relayrl.coordinator.clients import GeneratorPool, LearnerClient, RewardPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.loop import Experiment
from relayrl.coordinator.runfolder import rewind_records
from relayrl.coordinator.service_set import ServiceSet
from relayrl.coordinator.trackers import Trackers


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
    critic = LearnerClient(services.critic, deadline, security) if services.critic else None
    reference = LearnerClient(services.reference, deadline, security) if services.reference else None
    wait_s = cfg.services.replica_wait_seconds

    async def readmit(name: str, address: str) -> None:
        """A generator serving again after a failure (a restarted container holds the initial
        weights): registered anew, and given the learner's current weights before it samples."""
        reg = await learner.register_generator(name, address)
        try:
            await learner.push_weights(reg.policy_version)
        except BaseException:
            # Left registered, a replica that failed again would fail every later push.
            await learner.unregister_generator(name)
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
    )
    rewards = RewardPool(services.rewards, deadline, security=security, wait_s=wait_s)
    trackers = Trackers(
        cfg.tracking, run_dir, cfg.model_dump(mode="json"), resume_step=state["step"] if state else None
    )

    def record(rec: dict) -> None:
        trackers.log(rec)
        if on_record:
            on_record(rec)

    exp = Experiment(cfg, run_dir, train_rows, test_rows, gens, rewards, learner, record, critic, reference)
    if stop is not None:
        exp.stop_requested = stop
    try:
        for name, addr in services.generators.items():
            await learner.register_generator(name, addr)
        if state is not None:
            await exp.resume(state["tag"], rewind_records(run_dir, state["step"]))
            print(f"resumed {run_dir.name} at step {exp.pos.step} (policy version {exp.version})", flush=True)
        await exp.run()
    finally:
        await gens.close()
        await rewards.close()
        trackers.close()
        for client in (learner, critic, reference):
            if client is not None:
                await client.close()
    return exp
