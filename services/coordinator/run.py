"""``relayrl run`` (and ``relayrl launch ray|slurm``): one experiment in a registry, served over
``CoordinatorService`` while it runs (so ``relayrl status/stop/list`` reach it), with progress
shown. Its services are local processes (the embedded default), Ray actors (``launch_ray``) or
steps of the Slurm job it runs in (``launch_slurm``); the run is the same.

Ctrl-C or SIGTERM once: the run ends its step, writes a checkpoint, stops the services it
started and exits 0, within ``services.stop_grace_seconds`` (past it the run is cancelled where
it waits, and exits 130 with its last checkpoint as the resume point). Twice, or while the
services still start: at once.

The run folder holds ``config.yaml`` (resolved), ``launch.jsonl`` (every command started),
``services/*.yaml`` (each service's section), ``logs/``, ``metrics.jsonl`` (one record per step),
``checkpoints/`` and ``reward_curve.png``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from relayrl.coordinator.assets import missing_inputs
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.records.progress import progress
from relayrl.coordinator.records.runfolder import load_records
from relayrl.coordinator.service.registry import FAILED, PENDING, STOPPED, Handle, Registry

logger = logging.getLogger(__name__)


def coordinator_address_file(cfg: ExperimentConfig) -> Path:
    return Path(cfg.runs_dir) / "coordinator.addr"


async def _run_and_serve(
    cfg: ExperimentConfig, resume_dir: Path | None, show, services_factory=None
) -> Handle:
    """Serve CoordinatorService (for ``relayrl status/stop/list``) while the experiment runs."""
    from relayrl.common.grpc_server import start_metrics_server
    from relayrl.coordinator.service.server import build

    registry = Registry(services_factory)
    handle_srv = build(registry)  # loopback, a free port
    await handle_srv.server.start()
    start_metrics_server(cfg.services.metrics_port, cfg.services.metrics_host)
    addr_file = coordinator_address_file(cfg)
    addr_file.parent.mkdir(parents=True, exist_ok=True)
    addr_file.write_text(f"127.0.0.1:{handle_srv.port}\n")
    # Both signals are handled here, explicitly: left to the default action SIGTERM (kill, a
    # scheduler, systemd) would end the process at once and orphan its services, and a process
    # started from a non-interactive shell inherits SIGINT ignored (asyncio then installs no
    # handler of its own, and Ctrl-C did nothing).
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    h: Handle | None = None

    def on_signal(name: str) -> None:
        if h is None:  # not started yet: nothing to save
            main.cancel()
        elif h.state == PENDING:  # its services still start: nothing to save, stop now
            print(f"\n{name}: stopping (no step taken yet)", file=sys.stderr, flush=True)
            registry.request_stop(h.run_id)
        elif not h.stop.is_set():
            print(
                f"\n{name}: stopping at the end of this step with a checkpoint "
                f"(at most {h.cfg.services.stop_grace_seconds:g} s; again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            registry.request_stop(h.run_id)
        else:
            print(f"\n{name}: stopping now", file=sys.stderr, flush=True)
            registry.request_stop(h.run_id)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        h = registry.start(cfg, resume_dir, on_record=show)
        print(
            f"run folder: {h.run_dir}  (coordinator on 127.0.0.1:{handle_srv.port}: relayrl status {h.run_id})",
            flush=True,
        )
        if cfg.services.embedded:
            print("starting learner, generator and reward services ...", flush=True)
        # wait: the run's lifetime; a stop (on_signal) ends it within services.stop_grace_seconds,
        # then its cleanup stops the services
        await h.task
        return h
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await handle_srv.stop(1.0)
        if addr_file.read_text().strip() == f"127.0.0.1:{handle_srv.port}":
            addr_file.unlink(missing_ok=True)


def run(
    cfg: ExperimentConfig, resume_dir: Path | None = None, services_factory=None, prog: str = "relayrl run"
) -> Path:
    """``relayrl run``: returns the run folder; exits non-zero with the reason if the run failed.
    ``services_factory``: see ``Registry`` (``relayrl launch ray`` passes its own, and its ``prog``)."""
    if resume_dir is None and (problems := missing_inputs(cfg)):
        raise SystemExit(f"{prog}: " + "; ".join(problems))
    show, close = progress(cfg.schedule.steps, 0)
    try:
        h = asyncio.run(_run_and_serve(cfg, resume_dir, show, services_factory))
    except asyncio.CancelledError:  # a signal before the run started: nothing to save
        print(f"{prog}: stopped before the run started", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        close()
    evals = [r["eval_accuracy"] for r in load_records(h.run_dir) if "eval_accuracy" in r]  # resumed too
    if h.state == FAILED:
        raise SystemExit(f"{prog}: {h.run_id} failed: {h.message}")
    if h.state == STOPPED:
        resume = f"continue with: {prog} --resume {h.run_dir}"
        if h.cut_short:
            saved = (h.run_dir / "checkpoints" / "coordinator.json").exists()
            print(
                f"{prog}: {h.run_id} {h.message}" + (f"; {resume}" if saved else ""),
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(128 + signal.SIGINT)
        print(f"{h.run_id}: stopped at step {h.step} with a checkpoint; {resume}", flush=True)
        return h.run_dir
    if evals:
        print(f"{h.cfg.schedule.eval_label}: {evals[0]:.3f} -> {evals[-1]:.3f}", flush=True)
    if (h.run_dir / "reward_curve.png").exists():
        print(f"reward curve: {h.run_dir / 'reward_curve.png'}", flush=True)
    print(f"{h.run_id}: {h.state} at step {h.step}", flush=True)
    return h.run_dir


def launch_ray(cfg: ExperimentConfig, resume_dir: Path | None = None) -> Path:
    """``relayrl launch ray``: ``run`` with the services as Ray actors in placement groups
    (``launch.ray``); the Ray connection ends with it (a private instance stops)."""
    from relayrl.coordinator.launch.ray.services import RayServices, cluster

    with cluster(cfg):
        return run(cfg, resume_dir, services_factory=RayServices, prog="relayrl launch ray")


def launch_slurm(cfg: ExperimentConfig, resume_dir: Path | None = None) -> Path:
    """``relayrl launch slurm``: ``run`` with the services as steps of the Slurm job this runs in
    (``launch.slurm``); a requeued job resumes the run it started."""
    from relayrl.coordinator.launch.slurm.services import SlurmServices, job

    with job(cfg) as requeued:
        if requeued is not None and resume_dir is None:
            from relayrl.coordinator.derive import load_experiment

            cfg, resume_dir = load_experiment(requeued / "config.yaml"), requeued
        return run(cfg, resume_dir, services_factory=SlurmServices, prog="relayrl launch slurm")
