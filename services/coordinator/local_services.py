"""The services of a run as local processes (the embedded default of ``relayrl run``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launcher import ServiceProcess


def learner_section(cfg: ExperimentConfig, run_dir: Path, role: str = "learner"):
    """The section a launcher hands to the learner ``role`` (``learner``: the actor, ``critic``,
    ``reference``) it starts: checkpoints go beside the run folder (``<run_dir>/checkpoints``)
    unless the experiment names another folder. The default counts as unset even when present, as
    in a resumed run's ``config.yaml``, which records every field."""
    section = cfg.role_sections()[role]
    default = type(section).model_fields["checkpoint_dir"].default
    if section.checkpoint_dir != default:
        return section
    return section.model_copy(update={"checkpoint_dir": str(run_dir.parent.resolve())})


class LocalServices:
    """The embedded default: the run's learner, generators and reward replicas (and the critic
    and reference learners where the algorithm uses them) as local processes (a ``ServiceSet``),
    each with its config section in ``services/`` and its log in ``logs/`` of the run folder,
    every command recorded in ``launch.jsonl``."""

    resume_command = "relayrl run --resume"
    """What a failed run's message tells the user to continue with."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.procs: list[ServiceProcess] = []
        self.generators: dict[str, str] = {}
        self.rewards: dict[str, str] = {}
        self.learner = ""
        self.critic = ""
        self.reference = ""

    def _start(self, name: str, service: str, section, extra: list[str], devices: str = "") -> ServiceProcess:
        path = self.run_dir / "services" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(cfg_mod.dump_yaml(section))
        env = {"CUDA_VISIBLE_DEVICES": devices} if devices else {}
        if self.cfg.services.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cfg.services.threads)
        proc = ServiceProcess(
            name, [service, "--config", str(path), "--port", "0", *extra], self.run_dir / "logs", env=env
        )
        with open(self.run_dir / "launch.jsonl", "a") as f:
            f.write(
                json.dumps({"name": name, "command": proc.command, "env": env, "time": time.time()}) + "\n"
            )
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 600.0) -> None:
        c = self.cfg
        dev = c.services.generator_devices
        devices = {
            "learner": c.services.learner_devices,
            "critic": c.services.critic_devices,
            "reference": c.services.reference_devices,
        }
        learners = {
            role: self._start(role, "learner", learner_section(c, self.run_dir, role), [], devices[role])
            for role in c.role_sections()
        }
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
        ready = {role: p.wait_ready(timeout) for role, p in learners.items()}
        self.learner = ready["learner"]
        self.critic = ready.get("critic", "")
        self.reference = ready.get("reference", "")
        self.generators = {p.name: p.wait_ready(timeout) for p in gens}
        self.rewards = {p.name: p.wait_ready(timeout) for p in rewards}

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
