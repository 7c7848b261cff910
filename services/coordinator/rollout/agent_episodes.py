"""Black-box agent episodes: the env runs an agent of its own (a ``harness`` env), which reaches
the model through the gateway (``relayrl.gateway.v1``). The lifecycle (attempts, redo, masking,
the env's session) is ``episodes.EpisodeSource``'s; here, each attempt opens a gateway session and
hands its endpoint to the env's Reset; one Step runs the agent to its end; the gateway's
CloseSession gives the episode's tokens, exactly as sampled; the env's Close (or a reward the
harness set on the gateway) gives its reward.

The gateway's calls of an episode are the generator prompts ``<prompt_id>/<i>/t<k>``, sampled as a
tool episode's turns are (``tool_episodes.py``): the same seed gives the same tokens either way.
An agent that kept its history gives one segment, which trains as one masked sample; one that
rewrote it gives several, each a learner sample with the episode's advantage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from relayrl.common.trajectories import segments_sample
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.envs import EnvPool
from relayrl.coordinator.clients.gateways import GatewayPool
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.rotation import Replica
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.rollout.episode import Episode
from relayrl.coordinator.rollout.episodes import Attempt, ChatTemplateUnfit, EpisodeSource, NothingToTrain
from relayrl.env.v1 import env_pb2 as ev
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.reward.v1 import reward_pb2 as rw


class AgentEpisodes(EpisodeSource):
    """Episodes an agent of the env's own plays through a gateway session (see the module doc)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        generators: GeneratorPool,
        envs: EnvPool,
        info: ev.EnvInfo,
        trace: Path | None = None,
        gateways: GatewayPool | None = None,
    ):
        super().__init__(cfg, generators, envs, info, trace)
        self.gateways = gateways

    async def prepare(self) -> None:
        if self.gateways is None:
            raise ChatTemplateUnfit(
                f"env {self.ep.env!r} runs an agent of its own, which reaches the model through a gateway: "
                "start one (services.gateway_replicas: 1) or name one (services.gateways)"
            )
        await super().prepare()

    async def _open(self, a: Attempt) -> None:
        """The attempt's gateway session: the env's agent samples through it."""
        room = min(self.cfg.sampling.max_tokens, self.ep.max_episode_tokens)
        a.held = await open_session(
            self.gateways,
            a.eid,
            self._sampling(a.evaluation, room),
            self.ep.max_episode_tokens,
            a.min_version,
            a.tag,
            agent_reward=self.ep.agent_reward,
        )
        a.gateway = a.held.endpoint

    async def _play(self, a: Attempt, rep: Replica, reset: ev.ResetResponse) -> Episode:
        """One Step: the agent runs to its end; then its tokens, as the gateway recorded them."""
        await self.envs.step(rep, ev.StepRequest(request_id=a.tag, session_id=reset.session_id))
        a.held.closed = await self.gateways.close_session(a.held.replica, a.held.key, a.tag)
        return episode_of(a.held.closed, a.pid, a.index)

    def _abandon(self, a: Attempt) -> None:
        if a.held is not None and a.held.closed is None:
            close_soon(self.gateways, a.held, a.tag)

    def _result(self, a: Attempt, close: ev.CloseResponse) -> rw.RewardResult:
        return harness_result(a.eid, a.held.closed, close, self.ep.malformed_call_penalty)


class AgentSilent(NothingToTrain):
    """The agent ended without one call to the model: nothing to train on (the episode is masked)."""

    kind = "agent_silent"


@dataclass
class Opened:
    """An episode's gateway session."""

    replica: Replica
    key: str
    endpoint: ev.GatewayEndpoint
    closed: gw.CloseSessionResponse | None = None
    """What CloseSession answered, once the session is closed."""


async def open_session(
    gateways: GatewayPool,
    eid: str,
    sampling: g.SamplingParams,
    max_episode_tokens: int,
    min_version: int,
    tag: str,
    agent_reward: bool = False,
) -> Opened:
    rep, resp = await gateways.open(
        gw.OpenSessionRequest(
            request_id=tag,
            episode_id=eid,
            sampling=sampling,
            max_episode_tokens=max_episode_tokens,
            min_version=min_version,
            agent_reward=agent_reward,
        )
    )
    endpoint = ev.GatewayEndpoint(base_url=resp.base_url, api_key=resp.session_key, model=resp.model)
    return Opened(rep, resp.session_key, endpoint)


def close_soon(gateways: GatewayPool, opened: Opened, tag: str) -> None:
    """End the session without waiting (the episode failed): its key stops working now."""
    if opened.replica.healthy:
        closing = asyncio.ensure_future(gateways.close_session(opened.replica, opened.key, tag))
        closing.add_done_callback(lambda f: f.cancelled() or f.exception())


def episode_of(closed: gw.CloseSessionResponse, pid: str, i: int) -> Episode:
    """The episode the gateway recorded: one sample and its loss mask, or, where the agent's
    history broke, one learner sample per segment (the group's sample then stands for them).
    Its reward result is left empty (the env's Close, or the harness's own, fills it).

    >>> t = common_pb2.Sample(prompt_token_ids=[1], completion_token_ids=[2, 3], logprobs=[-1, -1],
    ...                       finish_reason=common_pb2.FINISH_REASON_STOP)
    >>> seg = gw.Segment(sample=t, loss_mask=[1, 1], calls=[t])
    >>> e = episode_of(gw.CloseSessionResponse(segments=[seg], calls=1), "p", 3)
    >>> (e.sample.prompt_id, e.sample.sample_index, e.mask, e.turns, e.segments)
    ('p', 3, [1.0, 1.0], 1, None)
    >>> two = gw.CloseSessionResponse(segments=[seg, seg], calls=2, history_breaks=1)
    >>> e = episode_of(two, "p", 0)
    >>> len(e.segments), e.history_breaks, [s.prompt_id for s, _ in e.segments]
    (2, 1, ['p', 'p'])
    """
    if not closed.segments:
        raise AgentSilent("the agent ended without calling the model")
    calls = [c for seg in closed.segments for c in seg.calls]
    ep = Episode(common_pb2.Sample(), [], rw.RewardResult())
    ep.calls = calls
    ep.turns = len(calls)
    ep.tool_calls = sum(c.parse == common_pb2.TOOL_CALL_PARSE_OK for s in calls for c in s.tool_calls)
    ep.parse_failures = sum(c.parse != common_pb2.TOOL_CALL_PARSE_OK for s in calls for c in s.tool_calls)
    ep.truncated = closed.truncated > 0 or calls[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    ep.history_breaks = closed.history_breaks
    ep.malformed_calls = closed.malformed_calls
    parts = []
    for seg in closed.segments:
        s = common_pb2.Sample()
        s.CopyFrom(seg.sample)
        s.prompt_id, s.sample_index = pid, i
        parts.append((s, [float(x) for x in seg.loss_mask]))
    if len(parts) == 1:
        ep.sample, ep.mask = parts[0]
    else:
        ep.sample, ep.segments = segments_sample(calls, pid, i), parts
        ep.mask = [x for _, m in parts for x in m]
    versions = [v for c in calls for v in (c.policy_version, *(sp.version for sp in c.version_spans))]
    ep.version_spread = max(versions) - min(versions)
    return ep


def harness_result(
    eid: str, closed: gw.CloseSessionResponse, close: ev.CloseResponse, malformed_penalty: float = 0.0
) -> rw.RewardResult:
    """The episode's reward: the one the harness set on the gateway, else the env's; less
    ``malformed_penalty`` per malformed call, whose count is a component either way.

    >>> closed = gw.CloseSessionResponse(malformed_calls=2)
    >>> r = harness_result("p/0", closed, ev.CloseResponse(reward=1.0), 0.25)
    >>> r.reward, r.components["malformed_calls"]
    (0.5, 2.0)
    """
    reward, components = (
        (closed.reward, dict(closed.components))
        if closed.reward_set
        else (close.reward, dict(close.components))
    )
    components["malformed_calls"] = float(closed.malformed_calls)
    return rw.RewardResult(
        sample_id=eid,
        status=rw.SCORE_STATUS_OK,
        reward=reward - malformed_penalty * closed.malformed_calls,
        components=components,
    )
