"""``relayrl run``: one experiment in a registry, served over ``CoordinatorService`` while it runs
(so ``relayrl status/stop/list`` reach it), with progress shown; SIGTERM ends it like Ctrl-C and
stops the services it started.

The run folder holds ``config.yaml`` (resolved), ``launch.jsonl`` (every command started),
``services/*.yaml`` (each service's section), ``logs/``, ``metrics.jsonl`` (one record per step),
``checkpoints/`` and ``reward_curve.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from relayrl.coordinator.assets import missing_inputs
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.progress import progress
from relayrl.coordinator.registry import FAILED, Handle, Registry

logger = logging.getLogger(__name__)


def coordinator_address_file(cfg: ExperimentConfig) -> Path:
    return Path(cfg.runs_dir) / "coordinator.addr"


async def _run_and_serve(
    cfg: ExperimentConfig, resume_dir: Path | None, show, services_factory=None
) -> Handle:
    """Serve CoordinatorService (for ``relayrl status/stop/list``) while the experiment runs."""
    from relayrl.common.grpc_server import start_metrics_server
    from relayrl.coordinator.server import build

    registry = Registry(services_factory)
    handle_srv = build(registry)  # loopback, a free port
    await handle_srv.server.start()
    start_metrics_server(cfg.services.metrics_port, cfg.services.metrics_host)
    addr_file = coordinator_address_file(cfg)
    addr_file.parent.mkdir(parents=True, exist_ok=True)
    addr_file.write_text(f"127.0.0.1:{handle_srv.port}\n")
    # SIGTERM (kill, a scheduler, systemd) ends the run like Ctrl-C: cancelling the run's task
    # runs its cleanup, which stops the services this process started. Left to the default
    # action, the process would die at once and its services would live on, orphaned.
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    try:
        h = registry.start(cfg, resume_dir, on_record=show)
        print(
            f"run folder: {h.run_dir}  (coordinator on 127.0.0.1:{handle_srv.port}: relayrl status {h.run_id})",
            flush=True,
        )
        if cfg.services.embedded:
            print("starting learner, generator and reward services ...", flush=True)
        try:
            await asyncio.shield(h.task)
        except asyncio.CancelledError:  # Ctrl-C or SIGTERM
            # Cancelling the run's task ends it where it waits, and its cleanup stops the services.
            # The stop flag also ends it at the next step, should anything on its way swallow that
            # cancellation: a Ctrl-C on `relayrl launch ray` once left a run stepping on (CI).
            h.stop.set()
            h.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await h.task
            raise
        return h
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
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
    except asyncio.CancelledError:  # SIGTERM: the services are stopped by now
        print(f"{prog}: terminated (SIGTERM); services stopped", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        close()
    evals = [r["eval_accuracy"] for r in h.records if "eval_accuracy" in r]
    if h.state == FAILED:
        raise SystemExit(f"{prog}: {h.run_id} failed: {h.message}")
    if evals:
        print(f"{h.cfg.schedule.eval_label}: {evals[0]:.3f} -> {evals[-1]:.3f}", flush=True)
    if (h.run_dir / "reward_curve.png").exists():
        print(f"reward curve: {h.run_dir / 'reward_curve.png'}", flush=True)
    print(f"{h.run_id}: {h.state} at step {h.step}", flush=True)
    return h.run_dir
