"""The services a run starts, listed once: what every launcher (local processes, Ray actors, Slurm
job steps) asks of the experiment before it places anything.

Beside the learner roles (``ExperimentConfig.role_sections``: the actor, and the critic and
reference its algorithm calls, each started with ``learner_section``), a run starts
``services.generator_replicas`` generators, ``services.reward_replicas`` reward replicas,
``services.env_replicas`` env replicas (only with an ``episodes`` section: nothing else talks to
them) and ``services.gateway_replicas`` gateways, in that order (``replicas``): the gateways last,
as they sample on the run's generators and are given their addresses. A replica is named
``<prefix>-<i>`` (``gen-0``, ``reward-1``, ``env-0``, ``gateway-0``): its name in the run folder's
logs and sections, in the coordinator's pools and on the learner's list of generators."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from relayrl.coordinator.config import ExperimentConfig

SERVICES = ("generator", "reward", "env", "gateway")
"""The replicated services (``relayrl serve <service>``), in the order a run starts them."""
PREFIX = {"generator": "gen", "reward": "reward", "env": "env", "gateway": "gateway"}
"""A replica's name is its service's prefix and its index."""


@dataclass(frozen=True)
class Replica:
    """One replica a run starts: the ``index``-th of ``service``."""

    service: str
    index: int

    @property
    def name(self) -> str:
        return f"{PREFIX[self.service]}-{self.index}"

    @property
    def serve_args(self) -> list[str]:
        """What ``relayrl serve <service>`` is given beside its section: a generator its replica
        id (the name it reports on every sample)."""
        return ["--replica-id", self.name] if self.service == "generator" else []


def count(cfg: ExperimentConfig, service: str) -> int:
    """How many replicas of ``service`` the run starts."""
    s = cfg.services
    return {
        "generator": s.generator_replicas,
        "reward": s.reward_replicas,
        "env": s.env_replicas if cfg.episodes is not None else 0,
        "gateway": s.gateway_replicas,
    }[service]


def replicas(cfg: ExperimentConfig, *services: str) -> list[Replica]:
    """The replicas of ``services`` (default: every one) the run starts, in start order.

    >>> raw = {"model": {"path": "m"}, "data": {"train": "t"},
    ...        "services": {"generator_replicas": 2, "env_replicas": 3}}
    >>> [r.name for r in replicas(ExperimentConfig.model_validate(raw))]  # no episodes: no env replica
    ['gen-0', 'gen-1', 'reward-0']
    >>> tools = ExperimentConfig.model_validate({**raw, "episodes": {"env": "calc"}})
    >>> [r.name for r in replicas(tools, "env", "gateway")]
    ['env-0', 'env-1', 'env-2']
    """
    return [Replica(svc, i) for svc in services or SERVICES for i in range(count(cfg, svc))]


def service_of(name: str) -> str | None:
    """The service of the replica ``name`` (None for a name no replica has: a learner's).

    >>> service_of("gen-3"), service_of("gateway-0"), service_of("learner"), service_of("critic-rank1")
    ('generator', 'gateway', None, None)
    """
    prefix, _, index = name.rpartition("-")
    return next((svc for svc, p in PREFIX.items() if p == prefix and index.isdigit()), None)


def pick(addresses: dict[str, str], service: str) -> dict[str, str]:
    """The replicas of ``service`` among ``addresses`` (name -> address), in their order."""
    return {n: a for n, a in addresses.items() if service_of(n) == service}


def service_section(cfg: ExperimentConfig, service: str):
    """The config section a replica of ``service`` runs with (a gateway's without the addresses of
    the run's generators, which its launcher fills in)."""
    return {"generator": cfg.generator, "reward": cfg.reward, "env": cfg.env, "gateway": cfg.gateway}[service]


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


def rendezvous_file(run_dir: Path, role: str) -> Path:
    """Where the learner ``role``'s rank 0 publishes its training rendezvous port for the other
    ranks (``RELAYRL_RENDEZVOUS_FILE``, learner/rendezvous.py): in the run folder, which every
    node shares, and new at every start so that no rank reads an earlier start's port."""
    return run_dir / "rendezvous" / f"{role}-{uuid.uuid4().hex[:12]}.port"
