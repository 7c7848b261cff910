"""Wire one experiment to its services and run the loop: the clients of the run
(``clients.run_clients``), the algorithm (``algorithms.make``) and the rollout source
(``rollout.make``), generators registered for weight sync, and on resume the learner's checkpoint
loaded and the experiment put back where it stopped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from relayrl.coordinator import algorithms, rollout
from relayrl.coordinator.clients.run_clients import RunClients
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.service_set import ServiceSet
from relayrl.coordinator.loop import Experiment
from relayrl.coordinator.records.runfolder import rewind_records
from relayrl.coordinator.records.trackers import Trackers


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
    scored = cfg.episodes is not None  # the env scores episodes: no reward columns needed
    train_rows = load_rows(cfg.data.train, scored)
    test_rows = load_rows(cfg.data.test, scored) if cfg.data.test else []
    clients = RunClients(cfg, services, algorithms.roles(cfg))
    # Opening them may talk to W&B or purge TensorBoard's files: not on the event loop.
    trackers = await asyncio.to_thread(
        Trackers, cfg.tracking, run_dir, cfg.model_dump(mode="json"), state["step"] if state else None
    )

    def record(rec: dict) -> None:
        trackers.log(rec)
        if on_record:
            on_record(rec)

    algorithm = algorithms.make(cfg, clients.roles, run_dir.name)
    trace = None if resume else run_dir / "episodes" / "first.jsonl"
    try:
        await clients.register_generators()
        rollouts = await rollout.make(
            cfg, clients.generators, clients.rewards, clients.envs, clients.gateways, trace
        )
        await rollouts.prepare()
        gens, lock = clients.generators, clients.weights_lock
        exp = Experiment(
            cfg, run_dir, train_rows, test_rows, gens, rollouts, clients.learner, algorithm, record, lock
        )
        clients.version = lambda: exp.version  # what a generator readmitted from now on is pushed
        if stop is not None:
            exp.stop_requested = stop
        if state is not None:
            rewind_records(run_dir, state["step"], "ledger.jsonl")
            await exp.resume(state["tag"], rewind_records(run_dir, state["step"]))
            print(f"resumed {run_dir.name} at step {exp.pos.step} (policy version {exp.version})", flush=True)
        await exp.run()
    finally:
        await clients.close()
        await trackers.aclose()
    return exp
