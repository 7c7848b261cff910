"""Making rollouts: where a step's scored samples come from, one source per kind, picked by
``make`` as ``algorithms.make`` picks a family. The loop only calls a ``RolloutSource``
(``base.py``: what it asks and the ``Rollout`` it gets back) and never asks which kind it has.

``single_turn.py`` (one Generate and one Score call per batch), ``episodes.py`` (the lifecycle
every episode source shares: attempts, redo, masking, the env's session), ``tool_episodes.py``
(the model's turns stepped by the env) and ``agent_episodes.py`` (an agent of the env's own,
through a gateway); ``episode.py`` (one episode's record, the step's episode metrics and trace)."""

from __future__ import annotations

from pathlib import Path

from relayrl.coordinator.clients.envs import EnvPool
from relayrl.coordinator.clients.gateways import GatewayPool
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.rewards import RewardPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.rollout.agent_episodes import AgentEpisodes
from relayrl.coordinator.rollout.base import Rollout, RolloutSource
from relayrl.coordinator.rollout.episodes import ChatTemplateUnfit
from relayrl.coordinator.rollout.single_turn import SingleTurn
from relayrl.coordinator.rollout.tool_episodes import ToolEpisodes

__all__ = ["Rollout", "RolloutSource", "make"]


async def make(
    cfg: ExperimentConfig,
    generators: GeneratorPool,
    rewards: RewardPool | None = None,
    envs: EnvPool | None = None,
    gateways: GatewayPool | None = None,
    trace: Path | None = None,
) -> RolloutSource:
    """The experiment's rollout source: without an ``episodes`` section, single-turn samples that
    ``rewards`` scores; with one, episodes of its env on ``envs``, asked here what the env is
    (``ChatTemplateUnfit`` when a replica does not run it): an env that runs an agent of its own
    (``EnvInfo.black_box``) gets agent episodes through ``gateways``, any other tool episodes.
    ``trace``: where the first training rollout's first episodes are written."""
    if cfg.episodes is None:
        return SingleTurn(cfg, generators, rewards)
    try:
        info = await envs.env_info(cfg.episodes.env)
    except ValueError as e:
        raise ChatTemplateUnfit(str(e)) from None
    if info.black_box:
        return AgentEpisodes(cfg, generators, envs, info, trace, gateways)
    return ToolEpisodes(cfg, generators, envs, info, trace)
