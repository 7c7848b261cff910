"""Run one experiment end to end: prepare model and data, bring up (or reach) the services, drive
the loop, and leave a run folder a person can read.

The run folder holds ``config.yaml`` (resolved), ``launch.jsonl`` (every command started),
``services/*.yaml`` (each service's section), ``logs/``, ``metrics.jsonl`` (one record per step),
``checkpoints/`` and ``reward_curve.png``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.common.security import client_channel
from relayrl.coordinator.assets import missing_inputs
from relayrl.coordinator.clients import GeneratorPool, RewardPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launcher import ServiceProcess
from relayrl.coordinator.loop import Experiment, Position, learner_checkpoint_path
from relayrl.coordinator.registry import FAILED, Handle, Registry
from relayrl.coordinator.runfolder import load_records
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

logger = logging.getLogger(__name__)


def learner_section(cfg: ExperimentConfig, run_dir: Path):
    """The learner section a launcher hands to the learner it starts: checkpoints go beside the run
    folder (``<run_dir>/checkpoints``) unless the experiment names another folder. The default
    counts as unset even when present, as in a resumed run's ``config.yaml``, which records every
    field."""
    default = type(cfg.learner).model_fields["checkpoint_dir"].default
    if cfg.learner.checkpoint_dir != default:
        return cfg.learner
    return cfg.learner.model_copy(update={"checkpoint_dir": str(run_dir.parent.resolve())})


class Services:
    """Addresses of the services, and the local processes when embedded."""

    resume_command = "relayrl run --resume"
    """What a failed run's message tells the user to continue with."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.procs: list[ServiceProcess] = []
        self.generators: dict[str, str] = {f"gen-{i}": a for i, a in enumerate(cfg.services.generators)}
        self.rewards: dict[str, str] = {f"reward-{i}": a for i, a in enumerate(cfg.services.rewards)}
        self.learner = cfg.services.learner or ""

    def _start(self, name: str, service: str, section, extra: list[str], devices: str = "") -> ServiceProcess:
        path = self.run_dir / "services" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(cfg_mod.dump_yaml(section))
        env = {"CUDA_VISIBLE_DEVICES": devices} if devices else {}
        proc = ServiceProcess(
            name, [service, "--config", str(path), "--port", "0", *extra], self.run_dir / "logs", env=env
        )
        with open(self.run_dir / "launch.jsonl", "a") as f:
            f.write(
                json.dumps({"name": name, "command": proc.command, "env": env, "time": time.time()}) + "\n"
            )
        self.procs.append(proc)
        return proc

    def start_embedded(self, timeout: float = 600.0) -> None:
        c = self.cfg
        dev = c.services.generator_devices
        learner = self._start(
            "learner", "learner", learner_section(c, self.run_dir), [], c.services.learner_devices
        )
        gens = [
            self._start(
                f"gen-{i}",
                "generator",
                c.generator,
                ["--replica-id", f"gen-{i}"],
                dev[i] if i < len(dev) else "",
            )
            for i in range(c.services.generator_replicas)
        ]
        rewards = [
            self._start(f"reward-{i}", "reward", c.reward, []) for i in range(c.services.reward_replicas)
        ]
        self.learner = learner.wait_ready(timeout)
        self.generators = {p.name: p.wait_ready(timeout) for p in gens}
        self.rewards = {p.name: p.wait_ready(timeout) for p in rewards}

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def _progress(total: int, start: int):
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

        def show(rec: dict) -> None:
            if "reward_mean" in rec:
                bar.update(1)
            post = {k: f"{rec[k]:.3f}" for k in ("reward_mean", "eval_accuracy", "kl") if k in rec}
            bar.set_postfix(post)

        return show, bar.close

    def log_line(rec: dict) -> None:
        parts = [f"step {rec['step']}/{total}"] + [
            f"{k} {rec[k]:.3f}"
            for k in (
                "reward_mean",
                "eval_accuracy",
                "loss",
                "kl",
                "entropy",
                "time_generate",
                "time_train",
                "time_sync",
            )
            if k in rec
        ]
        print("  ".join(parts), flush=True)

    return log_line, lambda: None


def plot(run_dir: Path, records: list[dict]) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    if not steps and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="train reward (mean)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_accuracy"] for r in evals],
            "o-",
            label="held-out greedy accuracy",
        )
    ax.set_xlabel("step")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    out = run_dir / "reward_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


async def drive(
    cfg: ExperimentConfig,
    run_dir: Path,
    services: Services,
    resume: bool,
    on_record=None,
    stop: asyncio.Event | None = None,
) -> Experiment:
    """Run the loop against ``services``; returns the finished experiment."""
    from relayrl.common.data.dataset import load_rows

    train_rows = load_rows(cfg.data.train)
    test_rows = load_rows(cfg.data.test) if cfg.data.test else []
    channel = client_channel(
        services.learner, cfg.services.security, options=[("grpc.max_send_message_length", 256 << 20)]
    )
    learner = lg.LearnerServiceStub(channel)
    deadline = cfg.services.deadline_seconds

    def on_down(replica: str) -> None:  # a dead generator must not fail every later push
        asyncio.ensure_future(
            learner.UnregisterGenerator(lp.UnregisterGeneratorRequest(replica_id=replica), timeout=deadline)
        )

    gens = GeneratorPool(services.generators, deadline, on_down=on_down, security=cfg.services.security)
    rewards = RewardPool(services.rewards, deadline, security=cfg.services.security)
    exp = Experiment(cfg, run_dir, train_rows, test_rows, gens, rewards, learner, on_record)
    if stop is not None:
        exp.stop_requested = stop
    for name, addr in services.generators.items():
        await learner.RegisterGenerator(
            lp.RegisterGeneratorRequest(address=addr, replica_id=name), timeout=deadline
        )
    if resume:
        state = json.loads((run_dir / "checkpoints" / "coordinator.json").read_text())
        loaded = await learner.LoadCheckpoint(
            lp.LoadCheckpointRequest(path=learner_checkpoint_path(run_dir), tag=state["tag"]),
            timeout=deadline,
        )
        exp.pos = Position(**json.loads(loaded.client_state_json))
        exp.version = loaded.policy_version
        exp.records = load_records(run_dir)
        if exp.version:
            await exp.push()  # fresh generators hold the initial weights
        print(f"resumed {run_dir.name} at step {exp.pos.step} (policy version {exp.version})", flush=True)
    try:
        await exp.run()
    finally:
        await gens.close()
        await rewards.close()
        await channel.close()
    return exp


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
        await h.task
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
    show, close = _progress(cfg.schedule.steps, 0)
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
        print(f"held-out greedy accuracy: {evals[0]:.3f} -> {evals[-1]:.3f}", flush=True)
    if (h.run_dir / "reward_curve.png").exists():
        print(f"reward curve: {h.run_dir / 'reward_curve.png'}", flush=True)
    print(f"{h.run_id}: {h.state} at step {h.step}", flush=True)
    return h.run_dir
