"""What ``relayrl launch ray`` asks a Ray cluster for, and how learner ranks are numbered: pure
functions of the experiment config and of where Ray put the bundles, so they test without Ray.

In: an ``ExperimentConfig`` (``learner.world_size``, ``services.*_replicas``,
``generator.engine.tensor_parallel_size``, the ``ray`` section) and whether bundles hold GPUs.
Out: placement groups, each a list of bundles with the role of each bundle:

- ``learner``: one bundle per ZeRO-3 rank (one GPU each on GPUs), ``ray.learner_strategy``
  (PACK: one node when the ranks fit, several otherwise); likewise ``critic`` and ``reference``
  when the algorithm uses them (PPO), each a learner of its own with its own ranks;
- ``rollout``: one bundle per generator replica (``tensor_parallel_size`` GPUs, which vLLM needs on
  one node, hence one bundle), then one per reward, env and gateway replica (CPUs only), in the
  order ``launch/replicas.py`` lists them, ``ray.rollout_strategy``.

Separate groups, not one, because a group has one strategy: the learner wants its ranks packed
(NCCL inside a node is fastest) while replicas may be spread.

Then ``assign_ranks`` numbers the learner ranks from where the bundles landed, the way torchrun
would on each node: ranks on the same node are consecutive, LOCAL_RANK counts within the node,
every rank sees the node's learner GPUs in CUDA_VISIBLE_DEVICES and picks its own by LOCAL_RANK,
and MASTER_ADDR is the node of rank 0, whose store publishes its port in a file of the run folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.replicas import replicas
from relayrl.learner.config import RENDEZVOUS_FILE_VAR


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: its bundles and what runs in each."""

    name: str
    strategy: str
    bundles: list[dict[str, float]]
    roles: list[str]
    """``<learner role>-<rank slot>`` (``learner``, ``critic``, ``reference``), ``gen-<i>`` or
    ``reward-<i>``, one per bundle."""


def plan(cfg: ExperimentConfig, gpus: bool, run_id: str) -> list[GroupPlan]:
    """The placement groups for ``cfg``; ``gpus``: bundles hold GPUs (``ray.accelerator``).

    >>> from relayrl.coordinator.config import ExperimentConfig
    >>> cfg = ExperimentConfig.model_validate({"model": {"path": "m"}, "data": {"train": "t"},
    ...     "learner": {"world_size": 2}, "reward": {"workers": 2}})
    >>> [(g.name, g.strategy, g.bundles) for g in plan(cfg, gpus=False, run_id="r")]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('relayrl-r-learner', 'PACK', [{'CPU': 1.0}, {'CPU': 1.0}]),
     ('relayrl-r-rollout', 'PACK', [{'CPU': 1.0}, {'CPU': 2.0}])]

    PPO adds a group per learner role (the critic and the reference, here from ``resolve_paths``):

    >>> from relayrl.coordinator.derive import resolve_paths
    >>> ppo = resolve_paths(cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(
    ...     update={"advantage": "gae", "kl_coef": 0.1})}), None)
    >>> [(g.name, g.roles) for g in plan(ppo, gpus=True, run_id="r")][:3]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('relayrl-r-learner', ['learner-0', 'learner-1']), ('relayrl-r-critic', ['critic-0', 'critic-1']),
     ('relayrl-r-reference', ['reference-0'])]
    """
    r = cfg.ray
    rank = {"CPU": r.learner_cpus_per_rank, **({"GPU": 1.0} if gpus else {})}
    tp = cfg.generator.engine.tensor_parallel_size
    gen = {"CPU": r.generator_cpus, **({"GPU": float(tp)} if gpus else {})}
    reward = {"CPU": float(r.reward_cpus if r.reward_cpus is not None else cfg.reward.workers)}
    bundle = {
        "generator": gen,
        "reward": reward,
        "env": {"CPU": r.env_cpus},
        "gateway": {"CPU": r.gateway_cpus},
    }
    rollout = replicas(cfg)
    learners = [
        GroupPlan(
            f"relayrl-{run_id}-{role}",
            r.learner_strategy,
            [dict(rank) for _ in range(section.world_size)],
            [f"{role}-{i}" for i in range(section.world_size)],
        )
        for role, section in cfg.role_sections().items()
    ]
    return [
        *learners,
        GroupPlan(
            f"relayrl-{run_id}-rollout",
            r.rollout_strategy,
            [dict(bundle[rep.service]) for rep in rollout],
            [rep.name for rep in rollout],
        ),
    ]


def needs(groups: list[GroupPlan]) -> dict[str, float]:
    """Resources all groups reserve together.

    >>> needs([GroupPlan("a", "PACK", [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 2.0}], ["x", "y"])])
    {'CPU': 3.0, 'GPU': 1.0}
    """
    total: dict[str, float] = {}
    for g in groups:
        for b in g.bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0.0) + v
    return total


@dataclass(frozen=True)
class Slot:
    """Where one learner bundle landed: the node (Ray's id and IP) and the GPUs Ray gave it."""

    node_id: str
    ip: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankEnv:
    """The torch.distributed environment of the rank running in one slot."""

    rank: int
    local_rank: int
    node_rank: int
    env: dict[str, str] = field(default_factory=dict)


def _gpu_key(g: str):
    return (0, int(g), "") if g.isdigit() else (1, 0, g)


def assign_ranks(slots: list[Slot], rendezvous_file: str) -> list[RankEnv]:
    """Ranks for the learner slots (in bundle order), as torchrun would number them per node.

    Nodes are taken in order of their first bundle (bundle 0's node holds rank 0); within a node,
    slots go by GPU id (then bundle order on CPUs).

    >>> slots = [Slot("b", "10.0.0.2", ("3",)), Slot("a", "10.0.0.1", ("1",)),
    ...          Slot("b", "10.0.0.2", ("0",)), Slot("a", "10.0.0.1", ("0",))]
    >>> [(e.rank, e.local_rank, e.node_rank) for e in assign_ranks(slots, "/runs/r/rendezvous/learner-1.port")]
    [(1, 1, 0), (3, 1, 1), (0, 0, 0), (2, 0, 1)]
    >>> e = assign_ranks(slots, "/runs/r/rendezvous/learner-1.port")[1].env
    >>> e["MASTER_ADDR"], e["CUDA_VISIBLE_DEVICES"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]
    ('10.0.0.2', '0,1', '4', '2')
    >>> assign_ranks([Slot("a", "127.0.0.1"), Slot("a", "127.0.0.1")], "f")[1].env["LOCAL_RANK"]
    '1'
    """
    nodes: dict[str, list[int]] = {}
    for i, s in enumerate(slots):
        nodes.setdefault(s.node_id, []).append(i)
    for idx in nodes.values():
        idx.sort(key=lambda i: (_gpu_key(slots[i].gpus[0]) if slots[i].gpus else (0, 0, ""), i))
    order = [i for idx in nodes.values() for i in idx]
    master = slots[order[0]].ip
    out: dict[int, RankEnv] = {}
    rank = 0
    for node_rank, idx in enumerate(nodes.values()):
        devices = ",".join(g for i in idx for g in slots[i].gpus)
        for local, i in enumerate(idx):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(slots)),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(len(idx)),
                "GROUP_RANK": str(node_rank),
                "NODE_RANK": str(node_rank),
                "MASTER_ADDR": master,
                # rank 0's store binds a free port and publishes it there (learner/rendezvous.py)
                RENDEZVOUS_FILE_VAR: rendezvous_file,
            }
            if devices:  # the node's learner GPUs, so LOCAL_RANK picks this rank's own
                env["CUDA_VISIBLE_DEVICES"] = devices
            out[i] = RankEnv(rank, local, node_rank, env)
            rank += 1
    return [out[i] for i in range(len(slots))]
