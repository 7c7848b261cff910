"""The set of services one run drives, whoever started them: local processes
(``local.LocalServices``, the embedded default), Ray actors (``ray.services.RayServices``), steps
of a Slurm job (``slurm.services.SlurmServices``) or services deployed elsewhere
(``DeployedServices``: addresses from the experiment)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from relayrl.coordinator.config import ExperimentConfig


class ServiceSet(Protocol):
    """Where a run's services answer, and how they are brought up and down."""

    generators: dict[str, str]
    """Replica name -> address, filled by ``start``."""
    rewards: dict[str, str]
    """Replica name -> address, filled by ``start``."""
    envs: dict[str, str]
    """Env service replica name -> address, filled by ``start`` (empty without episodes)."""
    gateways: dict[str, str]
    """Gateway replica name -> gRPC address, filled by ``start`` (empty without black-box envs)."""
    learner: str
    """Rank 0's address, filled by ``start``."""
    roles: dict[str, str]
    """Rank 0's address of every learner role beside the actor the algorithm calls (``critic``,
    ``reference``), by role, filled by ``start``."""
    resume_command: str
    """The command a failed run's message tells the user to continue with."""

    def start(self) -> None:
        """Bring the services up (blocking) and fill the addresses."""

    def stop(self) -> None:
        """Take down what ``start`` brought up; idempotent, safe after a failed start."""

    def coming_back(self, name: str) -> bool:
        """Whether the replica ``name`` is being started again (it crashed and its supervisor
        restarts it): callers wait for it rather than give up after ``replica_wait_seconds``."""


class Addresses:
    """The addresses a ``ServiceSet`` fills, empty until its ``start``."""

    def __init__(self) -> None:
        self.generators: dict[str, str] = {}
        self.rewards: dict[str, str] = {}
        self.envs: dict[str, str] = {}
        self.gateways: dict[str, str] = {}
        self.learner = ""
        self.roles: dict[str, str] = {}


class DeployedServices:
    """Services someone else runs: their addresses are in the experiment's ``services`` section;
    a run starts and stops nothing."""

    resume_command = "relayrl run --resume"

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        self.generators = {f"gen-{i}": a for i, a in enumerate(cfg.services.generators)}
        self.rewards = {f"reward-{i}": a for i, a in enumerate(cfg.services.rewards)}
        self.envs = {f"env-{i}": a for i, a in enumerate(cfg.services.envs)}
        self.gateways = {f"gateway-{i}": a for i, a in enumerate(cfg.services.gateways)}
        self.learner = cfg.services.learner or ""
        # the role sections present are the roles the algorithm calls (derive.resolve_paths)
        self.roles = {r: getattr(cfg.services, r) for r in cfg.role_sections() if r != "learner"}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def coming_back(self, name: str) -> bool:
        return False  # their supervisor (Kubernetes, compose) does not tell: replica_wait_seconds
