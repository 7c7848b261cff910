"""The ``ray`` section of an experiment: placement of the services on a Ray cluster, read by
``relayrl launch ray`` (``ray/plan.py``, ``ray/services.py``) and ignored by ``relayrl run``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from relayrl.common.config import StrictModel

PlacementStrategy = Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"]


class RaySection(StrictModel):
    """``relayrl launch ray``: the services as Ray actors in placement groups (ignored by ``relayrl
    run``). Each learner rank gets a bundle of its own, as does each generator and reward replica;
    every actor runs the same ``relayrl serve`` process (or learner rank) as the embedded default."""

    address: str | None = None
    """Ray cluster to join: ``auto`` (the cluster this machine joined with ``ray start``), the
    head's ``HOST:PORT``, or ``ray://HOST:10001`` (Ray Client). None starts a private one-node Ray
    instance for this run on loopback, stopped when the run ends."""
    namespace: str = Field("relayrl", min_length=1, max_length=128)
    """Ray namespace of the run's actors and placement groups."""
    num_cpus: int | None = Field(None, ge=1, le=100_000)
    """Private instance only: logical CPUs it offers; None: the machine's cores."""
    num_gpus: int | None = Field(None, ge=0, le=100_000)
    """Private instance only: GPUs it offers; None: those it detects."""
    accelerator: Literal["auto", "gpu", "cpu"] = "auto"
    """gpu: each learner rank's bundle holds one GPU and each generator replica's
    ``generator.engine.tensor_parallel_size`` GPUs; cpu: bundles of CPUs only; auto: gpu when the
    cluster has GPUs."""
    learner_cpus_per_rank: float = Field(1.0, gt=0, le=1024)
    """CPUs in each learner rank's bundle (also the rank's OMP_NUM_THREADS, rounded down)."""
    learner_strategy: PlacementStrategy = "PACK"
    """Placement of the learner's bundles. PACK: as few nodes as possible (one when the ranks fit,
    else multi-node ZeRO-3); STRICT_PACK: one node or nothing."""
    generator_cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs in each generator replica's bundle."""
    reward_cpus: float | None = Field(None, gt=0, le=1024)
    """CPUs in each reward replica's bundle; None: ``reward.workers`` (its scoring processes)."""
    env_cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs in each env service replica's bundle (runs with an ``episodes`` section)."""
    gateway_cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs in each gateway replica's bundle (``services.gateway_replicas``, black-box episodes)."""
    rollout_strategy: PlacementStrategy = "PACK"
    """Placement of the generator, reward, env and gateway bundles (a placement group of their
    own); SPREAD puts replicas on different nodes."""
    bind: Literal["node", "all"] = "node"
    """Address each service binds: ``node``, the IP Ray knows its node by (what the others dial);
    ``all``, 0.0.0.0 (announced with the node IP). Off loopback a service needs TLS and a token or
    client CA in its ``serve`` section, or ``serve.insecure`` (see Who may call)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every service process on every node (Ray's runtime_env ``env_vars``), e.g.
    ``HF_HOME``, ``GLOO_SOCKET_IFNAME``, ``RELAYRL_TOKEN_FILE``: the driver's environment does not
    travel to the nodes. Paths in it are the nodes' own; no secret values here (run folders record
    the config), only paths to them."""
    start_timeout_seconds: float = Field(900.0, gt=0)
    """Limit for the placement groups to be placed and for every service to serve."""
    call_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    """Deadline of each call the driver makes to a service's actor once it runs (health checks,
    log tails, a free port): a call past it is a failed call, never a wait without end."""
    dead_after_timeouts: int = Field(3, ge=1, le=1000)
    """Health checks of a learner rank's actor that may go unanswered in a row (each within
    ``call_timeout_seconds``) before the rank counts as dead and every rank is stopped. One slow
    answer (a busy node, a slow GCS) is not a death; an actor Ray reports dead is one at once."""
