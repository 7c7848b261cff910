"""Tool episodes in the coordinator (``coordinator/rollout/tool_episodes.py`` over the episode
lifecycle of ``rollout/episodes.py``, as ``rollout.make`` builds them), against stand-in generator and
env clients: what is tested is how the coordinator runs turns, checks them and turns them into
learner samples, not the services (their own tests do that)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest
from relayrl.common.trajectories import PrefixViolation
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.algorithms.rewards import fresh_groups, reward_stats
from relayrl.coordinator.clients.envs import EpisodeLost
from relayrl.coordinator.config import (
    AlgorithmSection,
    EpisodesSection,
    SamplingSection,
    ScheduleSection,
    ServicesSection,
)
from relayrl.coordinator.rollout import make
from relayrl.coordinator.rollout.base import train_sample
from relayrl.coordinator.rollout.episodes import ChatTemplateUnfit, ToolsNeverCalled
from relayrl.coordinator.rollout.tool_episodes import ToolEpisodes
from relayrl.env.v1 import env_pb2 as ev
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.reward.v1 import reward_pb2 as rw

STOP = 99
PROMPT = [1, 2, 3]
BRIDGE = [7, 8]  # what the stand-in generator renders a tool answer as
TOOLS = json.dumps([{"type": "function", "function": {"name": "calc", "parameters": {}}}])


class Gen:
    """A generator pool: turn 0 calls the tool (completion 10 11 STOP), later turns answer
    (12 STOP). ``calls_tool`` False: never a tool call. ``drift``: later prompts re-rendered."""

    def __init__(self, calls_tool=True, drift=False, check=None, end=STOP, full=False, abort=False):
        """``end``: the token the tool-calling turn ends on; ``full``: later turns do not fit the
        context (OUT_OF_RANGE); ``abort``: the first call of every episode is aborted."""
        self.calls_tool, self.drift, self.end, self.full, self.abort = calls_tool, drift, end, full, abort
        self.check = check or g.CheckChatResponse(
            round_trip_ok=True, prefix_preserving=True, stop_token_ids=[STOP]
        )
        self.requests: list[tuple[str, g.SamplingParams, str]] = []
        self.histories: list[list[common_pb2.ChatMessage]] = []

    async def check_chat(self, tools_json, tool_format):
        return self.check

    async def generate(self, prompts, sampling, request_id, min_version=0, affinity=""):
        (p,) = prompts
        self.requests.append((p.prompt_id, sampling, affinity))
        first = p.prompt_id.endswith("/t0")
        if self.full and not first:
            raise FakeRpcError(
                grpc.StatusCode.OUT_OF_RANGE, "prompt has 600 tokens; the model takes at most 511"
            )
        if p.WhichOneof("input") == "messages":  # the first turn, or any turn stepwise
            assert p.messages.tools_json == TOOLS
            self.histories.append(list(p.messages.messages))
            ids = PROMPT if first else PROMPT + [50 + len(p.messages.messages)]
        else:
            prefix = list(p.continuation.prefix_token_ids)
            ids = (prefix[:-1] + [5] + BRIDGE) if self.drift else (prefix + BRIDGE)
        call = first and self.calls_tool
        s = common_pb2.Sample(
            prompt_id=p.prompt_id,
            prompt_token_ids=ids,
            completion_token_ids=[10, 11, self.end] if call else [12, STOP],
            logprobs=[-0.5, -0.25, -0.125] if call else [-1.0, -0.0625],
            finish_reason=common_pb2.FINISH_REASON_ABORT
            if self.abort and first
            else common_pb2.FINISH_REASON_STOP,
            policy_version=min_version,
            text="<tool_call>" if call else "42",
            tool_calls=[common_pb2.ToolCall(id="c0", name="calc", arguments_json="{}", parse=1)]
            if call
            else [],
        )
        return {p.prompt_id: [s]}


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code, details):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Env:
    """An env pool: a tool call gets a tool answer, an answer ends the episode with reward 1.
    ``lose``: how many attempts of every episode fail (the replica died). ``outcome``: Close's."""

    def __init__(self, lose=0, outcome=ev.OUTCOME_OK, expects_tools=True, reward=lambda session: 1.0):
        self.lose, self.outcome, self.expects_tools, self.reward = lose, outcome, expects_tools, reward
        self.resets: list[tuple[str, int, int]] = []
        self.open: set[str] = set()

    async def env_info(self, name):
        return ev.EnvInfo(name=name, tools_json=TOOLS, expects_tools=self.expects_tools, max_turns=4)

    async def reset(self, req):
        self.resets.append((req.episode_id, req.attempt, req.seed))
        if req.attempt < self.lose:
            raise EpisodeLost("env-0: Reset UNAVAILABLE: gone")
        sid = f"{req.episode_id}#{req.attempt}"
        self.open.add(sid)
        msgs = [common_pb2.ChatMessage(role="user", content="What is 6 * 7?")]
        return SimpleNamespace(name="env-0", healthy=True), ev.ResetResponse(
            session_id=sid, messages=msgs, tools_json=TOOLS, max_turns=4
        )

    async def step(self, rep, req):
        if req.action.tool_calls:
            obs = [common_pb2.ChatMessage(role="tool", content="42", tool_call_id="c0", name="calc")]
            return ev.StepResponse(observations=obs, tool_results=[ev.ToolResult(status=ev.TOOL_STATUS_OK)])
        return ev.StepResponse(done=True)

    async def close_session(self, rep, req):
        self.open.discard(req.session_id)
        return ev.CloseResponse(
            reward=self.reward(req.session_id), outcome=self.outcome, failure_kind="verifier_failed"
        )


def _cfg(n=2, **episodes):
    return SimpleNamespace(
        seed=5,
        episodes=EpisodesSection(env="calc", **episodes),
        sampling=SamplingSection(n=n, max_tokens=16),
        schedule=ScheduleSection(max_staleness=0, eval_samples=1),
        algorithm=AlgorithmSection(advantage="grpo"),
        services=ServicesSection(),
    )


def episodes(cfg, gen, env, trace=None, gateways=None):
    """The episode source ``rollout.make`` builds for ``env`` (it asks the env what it runs)."""
    return asyncio.run(make(cfg, gen, None, env, gateways, trace))


def _run(source, batch=(("p0", {"prompt": []}),), evaluation=False):
    return asyncio.run(source.rollout(list(batch), evaluation, "step1", 3))


def test_without_an_episodes_section_the_source_is_single_turn():
    from relayrl.coordinator.rollout.single_turn import SingleTurn

    cfg = _cfg()
    cfg.episodes = None
    assert isinstance(asyncio.run(make(cfg, Gen(), rewards=object())), SingleTurn)


def test_an_episode_is_one_sample_whose_environment_tokens_are_masked():
    gen, env = Gen(), Env()
    source = episodes(_cfg(), gen, env)
    assert isinstance(source, ToolEpisodes)  # the env runs no agent of its own
    ro = _run(source)
    ((row, samples, results),) = ro.groups
    assert [r.reward for r in results] == [1.0, 1.0] and all(r.status == rw.SCORE_STATUS_OK for r in results)
    s = samples[0]
    assert list(s.prompt_token_ids) == PROMPT
    # the model's turn, the environment's answer, the model's turn: one token stream
    assert list(s.completion_token_ids) == [10, 11, STOP, *BRIDGE, 12, STOP]
    assert ro.mask(s) == [1, 1, 1, 0, 0, 1, 1]
    assert list(s.logprobs) == [-0.5, -0.25, -0.125, 0.0, 0.0, -1.0, -0.0625]
    ts = train_sample(s, ro.mask(s), advantage=1.0)
    assert list(ts.loss_mask) == [1, 1, 1, 0, 0, 1, 1]
    # turns: seeded by their own prompt ids, each episode on one replica (affinity), stopping at end of turn
    assert [(pid, aff) for pid, _, aff in gen.requests if pid.startswith("p0/0/")] == [
        ("p0/0/t0", "p0/0"),
        ("p0/0/t1", "p0/0"),
    ]
    assert all(
        sp.seed == 5 and list(sp.stop_token_ids) == [STOP] and sp.tool_format == "hermes"
        for _, sp, _ in gen.requests
    )
    assert ro.stats["tool_calls_per_episode"] == 1 and ro.stats["turns_per_episode"] == 2
    assert ro.stats["episodes_without_tool_call"] == 0 and ro.stats["env_redo"] == 0
    assert ro.gen_tokens == 2 * 5  # the model's tokens only
    assert not env.open  # every session closed


def test_a_turn_that_does_not_extend_the_exact_tokens_stops_the_run():
    with pytest.raises(PrefixViolation, match="p0/./ turn 1|turn 1"):
        _run(episodes(_cfg(), Gen(drift=True), Env()))


def test_a_lost_episode_is_redone_with_the_same_seed():
    env = Env(lose=1)
    ro = _run(episodes(_cfg(n=1), Gen(), env))
    assert [r.reward for r in ro.groups[0][2]] == [1.0]
    assert ro.stats["env_redo"] == 1 and ro.stats["env_masked"] == 0
    (e0, a0, s0), (e1, a1, s1) = env.resets
    # the same episode, a new attempt, the same seed; the id is this process's and rollout's
    assert e0 == e1 and e0.endswith("/step1/p0/0") and (a0, a1) == (0, 1) and s0 == s1


def test_an_episode_lost_on_every_attempt_is_masked_never_a_zero_reward():
    cfg = _cfg(n=2, max_attempts=2)
    cfg.services = ServicesSection(max_reward_error_fraction=1.0)
    ro = _run(episodes(cfg, Gen(), Env(lose=5)))
    results = ro.groups[0][2]
    assert all(r.status == rw.SCORE_STATUS_ERROR for r in results)
    assert ro.stats["env_masked"] == 2
    groups, stats = fresh_groups(cfg, 3, ro)
    assert groups == [[]] and stats["unscored_samples"] == 2 and stats["dropped_stale_groups"] == 0
    assert reward_stats(cfg, ro)["reward_errors"] == 2


def test_an_episode_the_env_masks_stays_out_of_training_and_of_the_baseline():
    cfg = _cfg(n=2)
    cfg.services = ServicesSection(max_reward_error_fraction=1.0)
    ro = _run(episodes(cfg, Gen(), Env(outcome=ev.OUTCOME_MASK)))
    assert ro.stats["env_masked"] == 2 and ro.stats["tool_calls_per_episode"] == 1
    assert all("verifier_failed" in r.error for r in ro.groups[0][2])
    groups, _ = fresh_groups(cfg, 3, ro)
    assert groups == [[]]


def test_an_env_that_expects_tools_and_sees_none_trips_the_alarm_on_the_third_step():
    source = episodes(_cfg(zero_tool_alarm="fail"), Gen(calls_tool=False), Env())
    for _ in range(2):
        ro = _run(source)
        assert ro.stats["alarm_zero_tool_calls"] == 0 and ro.stats["episodes_without_tool_call"] == 2
    _run(source, evaluation=True)  # evaluations do not count
    with pytest.raises(ToolsNeverCalled, match="none in 3 training steps"):
        _run(source)
    warn = episodes(_cfg(), Gen(calls_tool=False), Env())
    assert [_run(warn).stats["alarm_zero_tool_calls"] for _ in range(4)] == [0, 0, 1, 1]
    quiet = episodes(_cfg(zero_tool_alarm="fail"), Gen(calls_tool=False), Env(expects_tools=False))
    assert all("alarm_zero_tool_calls" not in _run(quiet).stats for _ in range(4))


@pytest.mark.parametrize(
    ("check", "match"),
    [
        (
            g.CheckChatResponse(
                tools_missing_from_prompt=["calc"], round_trip_ok=True, prefix_preserving=True
            ),
            "out of the prompt",
        ),
        (
            g.CheckChatResponse(
                round_trip_ok=False, round_trip_detail="no <tool_call>", prefix_preserving=True
            ),
            "parse back",
        ),
        (
            g.CheckChatResponse(round_trip_ok=True, prefix_preserving=False, bridge_detail="turn 2 differs"),
            "turn 2 differs",
        ),
    ],
)
def test_a_chat_template_that_cannot_run_the_episodes_is_refused_before_the_first_step(check, match):
    with pytest.raises(ChatTemplateUnfit, match=match):
        asyncio.run(episodes(_cfg(), Gen(check=check), Env()).prepare())


def test_template_drift_may_be_allowed_explicitly():
    check = g.CheckChatResponse(round_trip_ok=True, prefix_preserving=False, stop_token_ids=[STOP])
    source = episodes(_cfg(allow_template_drift=True), Gen(check=check), Env())
    asyncio.run(source.prepare())
    assert source.stop_ids == [STOP]


def test_stepwise_renders_every_call_whole_and_trains_each_with_its_episodes_advantage():
    from relayrl.coordinator import algorithms

    cfg = _cfg(n=2, turns="stepwise")
    gen = Gen()
    env = Env(reward=lambda session: 1.0 if "/p0/0#" in session else 0.0)
    ro = _run(episodes(cfg, gen, env))
    # the second call's prompt is the whole dialogue: user, the model's call, the tool's answer
    second = gen.histories[-1]
    assert [m.role for m in second] == ["user", "assistant", "tool"]
    assert [c.name for c in second[1].tool_calls] == ["calc"] and second[2].content == "42"
    assert not ro.masks and sorted(ro.segments) == [("p0", 0), ("p0", 1)]
    assert [len(ro.segments["p0", i]) for i in range(2)] == [2, 2]
    batch = asyncio.run(algorithms.make(cfg, {}, "r").batch(0, 3, ro))
    assert len(batch.actor) == 4  # two episodes, two calls each
    adv = [t.advantage for t in batch.actor]
    assert adv[0] == adv[1] > 0 > adv[2] == adv[3]
    assert [list(t.completion_token_ids) for t in batch.actor[:2]] == [[10, 11, STOP], [12, STOP]]
    assert all(not t.loss_mask for t in batch.actor)


def test_stepwise_refuses_token_level_advantages():
    from relayrl.coordinator.algorithms.token import TokenFamily

    cfg = _cfg(turns="stepwise")
    cfg.algorithm = AlgorithmSection(advantage="reinforce_pp")
    with pytest.raises(ValueError, match="episodes.turns: stepwise"):
        TokenFamily.check(cfg)


def test_episodes_under_way_are_bounded():
    """``episodes.concurrency``: never more episodes (env sessions, Generate calls) at once."""

    class Counting(Env):
        def __init__(self):
            super().__init__()
            self.most = 0

        async def reset(self, req):
            out = await super().reset(req)
            self.most = max(self.most, len(self.open))
            await asyncio.sleep(0.01)  # let the others start, were they allowed to
            return out

    env = Counting()
    ro = _run(episodes(_cfg(n=4, concurrency=3), Gen(), env), batch=[(f"p{k}", {}) for k in range(3)])
    assert len(ro.groups) == 3 and env.most == 3 and not env.open


def test_the_first_training_rollout_leaves_a_trace_of_two_episodes(tmp_path):
    path = tmp_path / "episodes" / "first.jsonl"
    source = episodes(_cfg(n=2), Gen(), Env(), trace=path)
    _run(source, evaluation=True)
    assert not path.exists()  # evaluations are not traced
    _run(source)
    _run(source)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert [t["call"]["promptId"] for t in first["turns"]] == ["p0/0/t0", "p0/0/t1"]
    assert first["turns"][0]["answer"][0]["content"] == "42" and first["turns"][1]["answer"] == []
    assert first["sample"]["completionTokenIds"] == [10, 11, STOP, *BRIDGE, 12, STOP]
    assert first["loss_mask"] == [1, 1, 1, 0, 0, 1, 1] and first["result"]["reward"] == 1.0


def test_a_turn_that_cannot_be_extended_ends_the_episode_not_the_run():
    """A turn stopped on an end token that is not the template's end of turn (vLLM stops on every
    end token of the model's config), or a next turn that would not fit the model's context
    (the generator answers OUT_OF_RANGE with ``fit_to_context``), ends its episode there: it is
    scored as the env scores an unfinished episode and counted as truncated."""
    for gen in (Gen(end=98), Gen(full=True)):
        ro = _run(episodes(_cfg(n=2), gen, Env()))
        assert ro.stats["episodes_truncated"] == 2 and ro.stats["turns_per_episode"] == 1
        assert [len(s.completion_token_ids) for s in ro.groups[0][1]] == [3, 3]
        assert all(sp.fit_to_context for _, sp, _ in gen.requests)


def test_an_aborted_turn_redoes_the_episode():
    ro = _run(episodes(_cfg(n=1, max_attempts=2), Gen(abort=True), Env()))
    assert ro.stats["env_masked"] == 1 and ro.stats["env_redo"] == 2  # never scored
