"""Black-box episodes in the coordinator (``coordinator/rollout/agent_episodes.py`` over the episode
lifecycle of ``rollout/episodes.py``, as ``rollout.make`` builds them), against stand-in env and
gateway clients: a gateway session per episode
whose endpoint reaches the env's Reset, the recorded segments as the episode's learner samples,
the harness's own reward preferred, and an agent that never called the model masked (never a
reward of 0)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.envs import EpisodeLost
from relayrl.coordinator.rollout.agent_episodes import AgentEpisodes
from relayrl.coordinator.rollout.episodes import ChatTemplateUnfit
from relayrl.env.v1 import env_pb2 as ev
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.reward.v1 import reward_pb2 as rw

from tests.unit.test_episodes import STOP, TOOLS, Gen, _cfg, episodes

REP = SimpleNamespace(name="gateway-0", healthy=True)


def segment(prompt, completion, mask, reason=""):
    call = common_pb2.Sample(prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
                             finish_reason=common_pb2.FINISH_REASON_STOP, policy_version=3)  # fmt: skip
    whole = common_pb2.Sample(prompt_token_ids=prompt, completion_token_ids=completion,
                              logprobs=[-0.5] * len(completion), policy_version=3)  # fmt: skip
    return gw.Segment(sample=whole, loss_mask=mask, calls=[call], break_reason=reason)


class Gateways:
    """A gateway pool whose sessions close with ``answer(key)``."""

    def __init__(self, answer):
        self.answer = answer
        self.opened: list[gw.OpenSessionRequest] = []
        self.closed: list[str] = []

    async def open(self, req):
        self.opened.append(req)
        key = f"key-{len(self.opened)}"
        return REP, gw.OpenSessionResponse(session_key=key, base_url="http://127.0.0.1:1/v1", model="m")

    async def close_session(self, rep, key, request_id):
        self.closed.append(key)
        return self.answer(key)


class BlackBoxEnv:
    """An env pool running a harness env: one Step runs the agent; Close gives reward 0.25."""

    def __init__(self, lose_steps=0, close=None):
        self.lose_steps = lose_steps
        self.resets: list[ev.ResetRequest] = []
        self.steps = 0
        self.closed: list[str] = []
        self.close = close or ev.CloseResponse(
            reward=0.25, outcome=ev.OUTCOME_OK, components={"correctness": 0.25}
        )

    async def env_info(self, name):
        return ev.EnvInfo(name=name, tools_json=TOOLS, expects_tools=True, max_turns=4, black_box=True)

    async def reset(self, req):
        self.resets.append(req)
        return SimpleNamespace(name="env-0", healthy=True), ev.ResetResponse(
            session_id=f"s{len(self.resets)}"
        )

    async def step(self, rep, req):
        self.steps += 1
        assert req.step_index == 0 and not req.action.text
        if self.steps <= self.lose_steps:
            raise EpisodeLost("env-0: Step UNAVAILABLE: gone")
        return ev.StepResponse(done=True)

    async def close_session(self, rep, req):
        self.closed.append(req.session_id)
        return self.close


def _run(source):
    return asyncio.run(source.rollout([("p0", {"prompt": []})], False, "step1", 3))


def test_a_black_box_episode_is_its_gateway_segment_with_the_envs_reward():
    env, gws = BlackBoxEnv(), Gateways(lambda key: gw.CloseSessionResponse(
        segments=[segment([1, 2], [10, STOP, 7, 8, 12, STOP], [1, 1, 0, 0, 1, 1])], calls=2))  # fmt: skip
    source = episodes(_cfg(), Gen(), env, None, gws)
    assert isinstance(source, AgentEpisodes)  # the env runs an agent of its own
    ro = _run(source)
    ((_, samples, results),) = ro.groups
    assert [r.reward for r in results] == [0.25, 0.25] and all(
        r.status == rw.SCORE_STATUS_OK for r in results
    )
    s = samples[1]
    assert (s.prompt_id, s.sample_index, list(s.completion_token_ids)) == (
        "p0",
        1,
        [10, STOP, 7, 8, 12, STOP],
    )
    assert ro.mask(s) == [1, 1, 0, 0, 1, 1] and not ro.segments
    # One session per episode, named as the white-box turns are, sampled as the first turn is.
    assert sorted(r.episode_id for r in gws.opened) == ["p0/0", "p0/1"]
    opened = gws.opened[0]
    assert (
        opened.min_version == 3
        and opened.max_episode_tokens == 1024
        and list(opened.sampling.stop_token_ids) == [STOP]
    )
    assert (
        opened.sampling.seed == 5
        and opened.sampling.max_tokens == 16
        and opened.sampling.tool_format == "hermes"
    )
    assert {r.gateway.api_key for r in env.resets} == {"key-1", "key-2"} and sorted(gws.closed) == [
        "key-1",
        "key-2",
    ]
    assert ro.stats["turns_per_episode"] == 1 and ro.stats["history_breaks"] == 0


def test_a_harness_reward_wins_and_a_broken_history_trains_per_segment():
    def answer(key):
        segs = [
            segment([1], [10, STOP], [1, 1]),
            segment([4], [11, 12, STOP], [1, 1, 1], "history_rewritten"),
        ]
        return gw.CloseSessionResponse(segments=segs, calls=2, history_breaks=1, reward_set=True, reward=1.0,
                                       components={"tests_passed": 1.0})  # fmt: skip

    ro = _run(episodes(_cfg(), Gen(), BlackBoxEnv(), None, Gateways(answer)))
    ((_, samples, results),) = ro.groups
    assert [r.reward for r in results] == [1.0, 1.0] and dict(results[0].components) == {
        "tests_passed": 1.0,
        "malformed_calls": 0.0,
    }
    train = ro.train_samples(samples[0], advantage=0.5)
    assert [list(t.completion_token_ids) for t in train] == [[10, STOP], [11, 12, STOP]]
    assert [list(t.loss_mask) for t in train] == [[1, 1], [1, 1, 1]]
    assert ro.stats["history_breaks"] == 2  # one per episode


def test_an_agent_that_never_called_the_model_is_masked_not_scored_zero():
    env = BlackBoxEnv()
    ro = _run(episodes(_cfg(), Gen(), env, None, Gateways(lambda key: gw.CloseSessionResponse())))
    ((_, _, results),) = ro.groups
    assert all(r.status == rw.SCORE_STATUS_ERROR and "agent_silent" in r.error for r in results)
    assert ro.stats["env_masked"] == 2 and ro.stats["env_masked_agent_silent"] == 2
    assert sorted(env.closed) == ["s1", "s2"]  # the env sessions are freed, not left to their lease


def test_masked_episodes_are_counted_by_reason_and_logged_once_each(caplog):
    # Two reasons in one rollout: an agent that stayed silent, and one the env masked.
    masked = ev.CloseResponse(outcome=ev.OUTCOME_MASK, failure_kind="Tool Crashed", failure_reason="boom")
    env = BlackBoxEnv(close=masked)
    calls = iter(
        [gw.CloseSessionResponse(), gw.CloseSessionResponse(segments=[segment([1], [10, STOP], [1, 1])])]
    )
    with caplog.at_level("WARNING", logger="relayrl.coordinator.rollout.episodes"):
        ro = _run(episodes(_cfg(), Gen(), env, None, Gateways(lambda key: next(calls))))
    assert ro.stats["env_masked"] == 2
    assert ro.stats["env_masked_agent_silent"] == 1 and ro.stats["env_masked_tool_crashed"] == 1
    lines = [r.getMessage() for r in caplog.records if "masked" in r.getMessage()]
    assert len(lines) == 2 and any("(agent_silent)" in m for m in lines)
    assert any("(Tool Crashed): boom" in m for m in lines)


@pytest.mark.parametrize("penalty", [0.0, 0.1])
def test_malformed_calls_are_counted_and_cost_what_the_experiment_says(penalty):
    cfg = _cfg(n=1)
    cfg.episodes.malformed_call_penalty = penalty
    gws = Gateways(lambda key: gw.CloseSessionResponse(segments=[segment([1], [10, STOP], [1, 1])], calls=1,
                                                       malformed_calls=2))  # fmt: skip
    ro = _run(episodes(cfg, Gen(), BlackBoxEnv(), None, gws))
    (result,) = ro.groups[0][2]
    assert result.status == rw.SCORE_STATUS_OK and result.reward == pytest.approx(0.25 - 2 * penalty)
    assert result.components["malformed_calls"] == 2.0 and ro.stats["malformed_calls"] == 2


def test_a_silent_agent_whose_env_said_redo_is_run_again():
    # The env knows why the agent was silent (its sandbox failed): infrastructure, so a redo.
    redo = ev.CloseResponse(outcome=ev.OUTCOME_REDO, failure_kind="sandbox_unavailable")
    env = BlackBoxEnv(close=redo)
    ro = _run(episodes(_cfg(n=1), Gen(), env, None, Gateways(lambda key: gw.CloseSessionResponse())))
    assert ro.stats["env_redo"] == 3 and len(env.resets) == 3  # max_attempts 3, then masked
    assert "episode_lost" in ro.groups[0][2][0].error


@pytest.mark.parametrize("allowed", [False, True])
def test_the_agents_own_reward_is_allowed_only_where_the_experiment_says(allowed):
    cfg = _cfg(n=1)
    cfg.episodes.agent_reward = allowed
    gws = Gateways(lambda key: gw.CloseSessionResponse(segments=[segment([1], [10, STOP], [1, 1])], calls=1))
    _run(episodes(cfg, Gen(), BlackBoxEnv(), None, gws))
    assert [r.agent_reward for r in gws.opened] == [allowed]


def test_a_lost_episode_closes_its_gateway_session_and_is_redone_with_a_new_one():
    env = BlackBoxEnv(lose_steps=1)
    gws = Gateways(lambda key: gw.CloseSessionResponse(segments=[segment([1], [10, STOP], [1, 1])], calls=1))
    ro = _run(episodes(_cfg(n=1), Gen(), env, None, gws))
    assert ro.groups[0][2][0].status == rw.SCORE_STATUS_OK and ro.stats["env_redo"] == 1
    assert len(gws.opened) == 2 and sorted(gws.closed) == ["key-1", "key-2"]  # the lost one closed too


def test_a_black_box_env_without_a_gateway_refuses_to_start():
    with pytest.raises(ChatTemplateUnfit, match="gateway"):
        asyncio.run(episodes(_cfg(), Gen(), BlackBoxEnv()).prepare())
