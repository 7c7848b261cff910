"""Where each service of a run goes in a Slurm allocation: pure, from the experiment and the
allocation's ``SLURM_*`` variables (``Allocation.from_env``).

The learner's ranks take the first nodes (one rank per GPU there; on CPU nodes all of
``world_size`` on the first node), generator replicas the nodes after them (``tensor_parallel_size``
GPUs each), cycling when there are more replicas than slots; a one-node allocation holds
everything. Reward, env and gateway replicas need no GPU: they run on the first node beside the
coordinator (the batch step), taking CPUs only.

Each service is one ``srun`` step. GPU steps ask for their GPUs (``--gres=gpu:N``, ``--exact``):
Slurm gives every step GPUs of its own, so two steps on one node never share a device. CPU-only
steps ``--overlap``: they share the node's CPUs with the others rather than waiting for free ones.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field

from relayrl.coordinator.config import ExperimentConfig


@dataclass(frozen=True)
class Allocation:
    """The allocation a batch script runs in."""

    job_id: str
    nodes: tuple[str, ...]
    gpus_per_node: int = 0
    restarts: int = 0
    """``SLURM_RESTART_COUNT``: how often the job was requeued."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Allocation:
        env = dict(os.environ) if env is None else env
        if "SLURM_JOB_ID" not in env:
            raise SystemExit(
                "relayrl launch slurm: not inside a Slurm allocation (no SLURM_JOB_ID): use sbatch"
            )
        nodes = expand(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
        if not nodes:
            raise SystemExit("relayrl launch slurm: SLURM_JOB_NODELIST is empty")
        return cls(env["SLURM_JOB_ID"], tuple(nodes), gpus(env), int(env.get("SLURM_RESTART_COUNT") or 0))


def gpus(env: dict[str, str]) -> int:
    """GPUs per node of the allocation (0 without GPUs).

    >>> gpus({"SLURM_GPUS_ON_NODE": "8"}), gpus({"SLURM_GPUS_PER_NODE": "h100:4"}), gpus({})
    (8, 4, 0)
    """
    for var in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS_PER_NODE"):
        value = env.get(var, "")
        if m := re.search(r"(\d+)\s*$", value.split(",")[0]):
            return int(m.group(1))
    return 0


def expand(nodelist: str) -> list[str]:
    """A Slurm node list as host names, by ``scontrol show hostnames`` (Slurm's own reading of
    its syntax); a plain comma-separated list without it.

    >>> expand("n1,n2")
    ['n1', 'n2']
    """
    if not nodelist:
        return []
    if "[" not in nodelist:
        return [n for n in nodelist.split(",") if n]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()


@dataclass(frozen=True)
class Step:
    """One ``srun`` step: a service replica (or a learner role's ranks)."""

    name: str
    nodes: tuple[str, ...]
    tasks_per_node: int = 1
    gpus_per_task: int = 0

    def srun(self, job_name: str) -> list[str]:
        """The ``srun`` words that start this step (the service's command follows)."""
        where = ["--nodes", str(len(self.nodes)), "--nodelist", ",".join(self.nodes)]
        tasks = [
            "--ntasks",
            str(len(self.nodes) * self.tasks_per_node),
            "--ntasks-per-node",
            str(self.tasks_per_node),
        ]
        if self.gpus_per_task:
            use = [
                "--exact",
                f"--gres=gpu:{self.gpus_per_task * self.tasks_per_node}",
                "--gpus-per-task",
                str(self.gpus_per_task),
            ]
        else:  # CPUs shared with the job's other steps (and more tasks than CPUs allowed)
            use = ["--overlap", "--overcommit"]
        return ["srun", f"--job-name={job_name}-{self.name}", "--kill-on-bad-exit=1", *where, *tasks, *use]


@dataclass
class Plan:
    steps: dict[str, Step] = field(default_factory=dict)


def plan(cfg: ExperimentConfig, alloc: Allocation) -> Plan:
    """The steps of ``cfg``'s services in ``alloc`` (see the module doc).

    >>> from relayrl.coordinator.config import ExperimentConfig
    >>> cfg = ExperimentConfig.model_validate({"model": {"path": "m"}, "data": {"train": "t"},
    ...     "learner": {"world_size": 8}, "services": {"generator_replicas": 4}})
    >>> p = plan(cfg, Allocation("7", ("a", "b", "c"), gpus_per_node=8))
    >>> p.steps["learner"].nodes, [p.steps[f"gen-{i}"].nodes for i in range(4)], p.steps["reward-0"].nodes
    (('a',), [('b',), ('b',), ('b',), ('b',)], ('a',))
    """
    out = Plan()
    nodes, g = list(alloc.nodes), alloc.gpus_per_node
    used = 0
    for role, section in cfg.role_sections().items():
        if g:
            per = min(g, section.world_size)
            if section.world_size % per:
                raise SystemExit(f"{role}: world_size {section.world_size} does not fill nodes of {g} GPUs")
            count = section.world_size // per
        else:
            per, count = section.world_size, 1
        take = nodes[used : used + count] if used + count <= len(nodes) else nodes[:count]
        if len(take) < count:
            raise SystemExit(
                f"{role}: {section.world_size} ranks need {count} nodes of {g} GPUs; the job has {len(nodes)}"
            )
        out.steps[role] = Step(role, tuple(take), per, 1 if g else 0)
        used = used + count if used + count <= len(nodes) else used
    rest = nodes[used:] or nodes  # one node: everything shares it
    tp = cfg.generator.engine.tensor_parallel_size
    slots = [n for n in rest for _ in range(max(1, g // tp) if g else 1)]
    for i in range(cfg.services.generator_replicas):
        out.steps[f"gen-{i}"] = Step(f"gen-{i}", (slots[i % len(slots)],), 1, tp if g else 0)
    for i in range(cfg.services.reward_replicas):
        out.steps[f"reward-{i}"] = Step(f"reward-{i}", (nodes[0],))
    for i in range(cfg.services.env_replicas if cfg.episodes is not None else 0):
        out.steps[f"env-{i}"] = Step(f"env-{i}", (nodes[0],))
    for i in range(cfg.services.gateway_replicas):
        out.steps[f"gateway-{i}"] = Step(f"gateway-{i}", (nodes[0],))
    return out
