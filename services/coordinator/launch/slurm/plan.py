"""Where each service of a run goes in a Slurm allocation: pure, from the experiment and the
allocation's ``SLURM_*`` variables (``Allocation.from_env``).

The learner's ranks take whole nodes first (one rank per GPU; on CPU nodes all of ``world_size``
on the first node), generator replicas the GPUs left after them (``tensor_parallel_size`` each,
in node order; on CPU nodes the nodes after the learner's, in turn), and a run that does not fit
is refused here, naming what is missing. Reward, env and gateway replicas need no GPU: they run on
the first node beside the coordinator.

A service that stays on the first node (where the batch step, and this process, run) is a plain
child process, its GPUs named by ``CUDA_VISIBLE_DEVICES`` (``Step.gpu_ids``): ``scancel``'s SIGTERM
reaches it directly, so it can serve on while the coordinator writes its last checkpoint
(``serve.term_linger_seconds``). A service on other nodes is an ``srun`` step: its GPUs are asked
for per node (``--gres``, ``--exact``: Slurm gives every step GPUs of its own), its CPUs shared
with the job's other steps (``--overlap``).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field

from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.replicas import replicas


@dataclass(frozen=True)
class Allocation:
    """The allocation a batch script runs in (its batch step on ``nodes[0]``)."""

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
    """One service replica (or a learner role's ranks): local on the first node, else an srun step."""

    name: str
    nodes: tuple[str, ...]
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    local: bool = False
    gpu_ids: tuple[int, ...] = ()
    """Local only: which of the batch step's GPUs it takes (indices into CUDA_VISIBLE_DEVICES)."""

    def srun(self, job_name: str) -> list[str]:
        """The ``srun`` words that start this step (the service's command follows). Every task
        sees all of the step's GPUs on its node (no per-task binding), so a learner rank's
        ``LOCAL_RANK`` picks its own."""
        where = ["--nodes", str(len(self.nodes)), "--nodelist", ",".join(self.nodes)]
        tasks = [
            "--ntasks",
            str(len(self.nodes) * self.tasks_per_node),
            "--ntasks-per-node",
            str(self.tasks_per_node),
        ]
        if self.gpus_per_node:
            use = ["--exact", f"--gres=gpu:{self.gpus_per_node}"]
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
    >>> p.steps["learner"].nodes, p.steps["learner"].local, [p.steps[f"gen-{i}"].nodes for i in range(4)]
    (('a',), True, [('b',), ('b',), ('b',), ('b',)])
    >>> one = plan(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"world_size": 4})}),
    ...            Allocation("7", ("a",), gpus_per_node=8))
    >>> one.steps["learner"].gpu_ids, [one.steps[f"gen-{i}"].gpu_ids for i in range(4)]
    ((0, 1, 2, 3), [(4,), (5,), (6,), (7,)])
    """
    out = Plan()
    nodes, g = list(alloc.nodes), alloc.gpus_per_node
    free = dict.fromkeys(nodes, g)
    first = nodes[0]

    def step(name: str, where: list[str], tasks: int, n_gpus: int) -> Step:
        local = where == [first]
        ids = tuple(range(g - free[first], g - free[first] + n_gpus)) if local and n_gpus else ()
        for n in where:
            free[n] -= n_gpus
        return Step(name, tuple(where), tasks, n_gpus, local, ids)

    for role, section in cfg.role_sections().items():
        per = min(g, section.world_size) if g else section.world_size
        if section.world_size % per:
            raise SystemExit(f"{role}: world_size {section.world_size} does not fill nodes of {g} GPUs")
        count = section.world_size // per
        whole = [n for n in nodes if free[n] == g and (g or n == first or count > 1)][:count]
        if len(whole) < count:
            raise SystemExit(
                f"{role}: {section.world_size} ranks need {count} node(s) of {g or 'CPU'} "
                f"{'GPUs' if g else ''} to themselves; the job has {len(nodes)} node(s), some taken"
            )
        out.steps[role] = step(role, whole, per, per if g else 0)
    tp = cfg.generator.engine.tensor_parallel_size
    cpu_turn = [n for n in nodes if n not in out.steps["learner"].nodes] or [first]
    for r in replicas(cfg, "generator"):
        if not g:
            out.steps[r.name] = step(r.name, [cpu_turn[r.index % len(cpu_turn)]], 1, 0)
            continue
        node = next((n for n in nodes if free[n] >= tp), None)
        if node is None:
            raise SystemExit(
                f"generator replica {r.index}: no node has {tp} GPUs left (tensor_parallel_size); the learner "
                f"takes {sum(s.gpus_per_node * len(s.nodes) for s in out.steps.values() if not s.name.startswith('gen-'))}, "
                f"the job has {g * len(nodes)}: add nodes or lower services.generator_replicas"
            )
        out.steps[r.name] = step(r.name, [node], 1, tp)
    for r in replicas(cfg, "reward", "env", "gateway"):
        out.steps[r.name] = step(r.name, [first], 1, 0)
    return out
