"""EnvService over a real grpc.aio server on port 0, with the built-in envs and the test plugins
(tests/kit/env_plugins.py).

What is checked: calc, guess and a TRL-style env end to end through Reset/Step/Close; tool calls
the model got wrong (parse errors, unknown tools, bad arguments) answered as observations while
the episode goes on; idempotent steps (a retried step is answered from the record, the tool ran
once) and their order; sessions (a retried Reset, max_sessions, leases, an idempotent Close);
env code that raises or hangs is REDO, never a reward; bounds and status codes; and that the
replica keeps serving after all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY
from relayrl.common.grpc_server import start
from relayrl.common.v1 import common_pb2 as c
from relayrl.env.config import EnvConfig
from relayrl.env.server import SERVICE, build
from relayrl.env.v1 import env_pb2 as e
from relayrl.env.v1 import env_pb2_grpc

from tests.kit import env_plugins
from tests.kit.serving import client
from tests.kit.waits import error_of, until

PLUGINS = [
    f"tests.kit.env_plugins:{n}"
    for n in ("Tools", "StepRaises", "ResetRaises", "RewardRaises", "StepHangs", "Masks", "Counter")
]
SERVING = health_pb2.HealthCheckResponse.SERVING
CALC_TASK = {
    "prompt": [{"role": "user", "content": "What is 123 * 456?"}],
    "reward_model": {"ground_truth": "56088"},
    "data_source": "calc",
    "extra_info": {"split": "test"},
}
ST = e.ToolStatus


@contextlib.asynccontextmanager
async def serving(**config):
    config = {"plugins": PLUGINS, "step_timeout_seconds": 5.0, "tool_timeout_seconds": 0.3, **config}
    handle = build(EnvConfig(**config))
    await start(handle, ready=True)
    try:
        async with client(handle, env_pb2_grpc.EnvServiceStub) as s:
            yield s
            # Whatever the test did, the replica still serves.
            health = await s.health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert health.status == SERVING
            await s.stub.ListEnvs(e.ListEnvsRequest(), timeout=5)
    finally:
        await handle.stop(0)


@pytest.fixture
async def svc():
    async with serving() as s:
        yield s


_episodes = iter(range(1 << 30))


async def reset(s, env="calc", task=None, seed=0, episode_id=None, attempt=0):
    task = CALC_TASK if task is None else task
    episode_id = episode_id or f"ep/{next(_episodes)}"
    req = e.ResetRequest(
        env=env, task_json=json.dumps(task), seed=seed, episode_id=episode_id, attempt=attempt
    )
    return await s.stub.Reset(req, timeout=10)


def call(name, arguments=None, id="call_0", parse=c.TOOL_CALL_PARSE_OK, raw=None):
    args = raw if raw is not None else json.dumps(arguments or {})
    return c.ToolCall(id=id, name=name, arguments_json=args, parse=parse)


async def step(s, session_id, index, text="", calls=(), finish=c.FINISH_REASON_STOP):
    action = e.Action(text=text, tool_calls=list(calls), finish_reason=finish)
    return await s.stub.Step(
        e.StepRequest(session_id=session_id, step_index=index, action=action), timeout=10
    )


async def close(s, session_id):
    return await s.stub.Close(e.CloseRequest(session_id=session_id), timeout=10)


def counted(name: str, labels: dict) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- episodes ------------------------------------------------------------------------------


async def test_list_envs_names_builtins_and_plugins(svc):
    resp = await svc.stub.ListEnvs(e.ListEnvsRequest())
    envs = {x.name: x for x in resp.envs}
    assert {"calc", "guess", "test/tools", "counter"} <= set(envs)
    calc = envs["calc"]
    assert calc.expects_tools and calc.max_turns == 4 and calc.description
    (schema,) = json.loads(calc.tools_json)
    assert schema["function"]["name"] == "calc"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert (
        not envs["guess"].expects_tools and envs["guess"].tools_json == "[]" and envs["guess"].max_turns == 8
    )
    assert resp.max_sessions == 1024 and resp.open_sessions == 0 and resp.replica_id


async def test_calc_episode_with_a_tool_call_is_rewarded(svc):
    before = counted("relayrl_env_tool_calls_total", {"env": "calc", "status": "ok"})
    r = await reset(svc)
    assert [(m.role, m.content) for m in r.messages][1:] == [("user", "What is 123 * 456?")]
    assert r.messages[0].role == "system" and "calc" in r.messages[0].content
    assert (
        r.max_turns == 4
        and r.lease_seconds == 1800
        and json.loads(r.tools_json)[0]["function"]["name"] == "calc"
    )
    s1 = await step(svc, r.session_id, 0, "<tool_call>", [call("calc", {"expression": "123 * 456"})])
    assert not s1.done
    assert [(m.role, m.content, m.tool_call_id, m.name) for m in s1.observations] == [
        ("tool", "56088", "call_0", "calc")
    ]
    assert [(x.tool_call_id, x.name, x.status) for x in s1.tool_results] == [
        ("call_0", "calc", ST.TOOL_STATUS_OK)
    ]
    s2 = await step(svc, r.session_id, 1, "So 123 * 456 = 56,088.")
    assert s2.done and not s2.observations and not s2.tool_results
    out = await close(svc, r.session_id)
    assert out.outcome == e.OUTCOME_OK and out.reward == 1.0
    assert dict(out.components) == {"correctness": 1.0, "tool_calls": 1.0, "turns": 2.0}
    assert counted("relayrl_env_tool_calls_total", {"env": "calc", "status": "ok"}) == before + 1


async def test_calc_wrong_cut_or_endless_answers_score_zero(svc):
    wrong = await reset(svc)
    assert (await step(svc, wrong.session_id, 0, "It is 56087")).done
    assert (await close(svc, wrong.session_id)).reward == 0.0
    # The right number in a turn cut at its token budget is no final answer.
    cut = await reset(svc)
    assert (await step(svc, cut.session_id, 0, "It is 56088", finish=c.FINISH_REASON_LENGTH)).done
    assert (await close(svc, cut.session_id)).reward == 0.0
    # Tool calls on every turn: the 4th turn (max_turns) ends the episode without an answer.
    endless = await reset(svc)
    for i in range(4):
        resp = await step(svc, endless.session_id, i, "", [call("calc", {"expression": "1+1"})])
        assert resp.done == (i == 3) and bool(resp.observations) == (i < 3)
    out = await close(svc, endless.session_id)
    assert out.reward == 0.0 and out.components["tool_calls"] == 4 and out.outcome == e.OUTCOME_OK


async def test_model_errors_in_tool_calls_are_observations_and_the_episode_goes_on(svc):
    r = await reset(svc)
    calls = [
        call("calc", raw='{"name": "calc", "arguments": {', id="a", parse=c.TOOL_CALL_PARSE_INVALID_JSON),
        call("", raw="<tool_call>{...", id="b", parse=c.TOOL_CALL_PARSE_UNCLOSED_BLOCK),
        call("calculator", {"expression": "1"}, id="c"),
        call("calc", {"expr": "1"}, id="d"),
        call("calc", {"expression": 7}, id="e"),
        call("calc", {"expression": "__import__('os').system('true')"}, id="f"),
        call("calc", {"expression": "2 ** 1000"}, id="g"),
        call("calc", raw="[1, 2]", id="h"),
    ]
    resp = await step(svc, r.session_id, 0, "", calls)
    assert not resp.done
    assert [x.status for x in resp.tool_results] == [
        ST.TOOL_STATUS_PARSE_ERROR,
        ST.TOOL_STATUS_PARSE_ERROR,
        ST.TOOL_STATUS_UNKNOWN_TOOL,
        ST.TOOL_STATUS_INVALID_ARGS,
        ST.TOOL_STATUS_INVALID_ARGS,
        ST.TOOL_STATUS_INVALID_ARGS,
        ST.TOOL_STATUS_INVALID_ARGS,
        ST.TOOL_STATUS_INVALID_ARGS,
    ]
    obs = [m.content for m in resp.observations]
    assert all(m.role == "tool" for m in resp.observations) and all(o.startswith("error: ") for o in obs)
    assert [m.tool_call_id for m in resp.observations] == list("abcdefgh")
    assert "not a JSON object" in obs[0] and "no closing tag" in obs[1]
    assert "no tool named 'calculator'; tools: calc" in obs[2]
    assert "expr" in obs[3] and "must be string" in obs[4]
    assert "function calls are not allowed" in obs[5] and "too large" in obs[6]
    assert all(len(o) < 700 for o in obs)
    ok = await step(svc, r.session_id, 1, "", [call("calc", {"expression": "(1 + 2) * 3"})])
    assert ok.observations[0].content == "9" and not ok.done
    await step(svc, r.session_id, 2, "56088")
    assert (await close(svc, r.session_id)).reward == 1.0


async def test_guess_episode(svc):
    r = await reset(svc, "guess", {"prompt": "Play.", "reward_model": {"ground_truth": 42}})
    assert [m.role for m in r.messages] == ["system", "user"] and "<guess>N</guess>" in r.messages[0].content
    assert r.tools_json == "[]" and r.max_turns == 8
    replies = []
    for i, text in enumerate(["<guess>32</guess>", "<guess>50</guess>", "hmm, 42?"]):
        resp = await step(svc, r.session_id, i, text)
        assert not resp.done and [m.role for m in resp.observations] == ["user"]
        replies.append(resp.observations[0].content)
    assert replies == ["higher", "lower", "error: write <guess>N</guess>"]
    # A tool call in a text env is answered UNKNOWN_TOOL, before the env's user turn.
    resp = await step(svc, r.session_id, 3, "<guess>40</guess>", [call("calc", {"expression": "1"})])
    assert [m.role for m in resp.observations] == ["tool", "user"] and resp.observations[
        1
    ].content == "higher"
    assert resp.tool_results[0].status == ST.TOOL_STATUS_UNKNOWN_TOOL
    done = await step(svc, r.session_id, 4, "<guess>10</guess> no, <guess>42</guess>")
    assert done.done and not done.observations
    out = await close(svc, r.session_id)
    assert out.reward == pytest.approx(0.6) and dict(out.components) == {"correctness": 1.0, "turns": 5.0}


async def test_guess_number_follows_seed_and_task():
    from relayrl.env.guess import hidden_number

    task = {"prompt": "Play."}
    assert hidden_number(task, 7) == hidden_number(dict(task), 7)
    assert len({hidden_number(task, seed) for seed in range(40)}) > 10
    assert all(1 <= hidden_number(task, seed) <= 63 for seed in range(200))


async def test_trl_style_class_runs_unchanged(svc):
    info = {x.name: x for x in (await svc.stub.ListEnvs(e.ListEnvsRequest())).envs}["counter"]
    schemas = {t["function"]["name"]: t["function"] for t in json.loads(info.tools_json)}
    assert set(schemas) == {"add", "crash"} and info.expects_tools
    assert schemas["add"]["description"] == "Add to the counter."
    assert schemas["add"]["parameters"]["properties"]["n"] == {
        "type": "integer",
        "description": "how much to add (may be negative)",
    }
    r = await reset(
        svc, "counter", {"prompt": [{"role": "user", "content": "Reach 5."}], "target": 5, "start": 1}
    )
    assert r.messages[-1].content == "Reach 5. Start at 1."
    resp = await step(svc, r.session_id, 0, "", [call("add", {"n": 3}, id="x"), call("crash", id="y")])
    assert [m.content for m in resp.observations][0] == "4"
    assert resp.observations[1].content.startswith("error: crash failed: ZeroDivisionError")
    assert [x.status for x in resp.tool_results] == [ST.TOOL_STATUS_OK, ST.TOOL_STATUS_CRASHED]
    await step(svc, r.session_id, 1, "", [call("add", {"n": 1})])
    assert (await step(svc, r.session_id, 2, "done")).done
    out = await close(svc, r.session_id)
    assert out.reward == 1.0 and out.outcome == e.OUTCOME_OK and out.components["tool_calls"] == 3


# ---- steps: idempotent, in order -----------------------------------------------------------


async def test_a_retried_step_is_answered_from_the_record_and_runs_once(svc):
    r = await reset(svc, "test/tools", {})
    key = f"replay-{r.session_id}"
    first = await step(svc, r.session_id, 0, "", [call("bump", {"key": key})])
    again = await step(svc, r.session_id, 0, "different text is ignored", [call("bump", {"key": key})])
    assert again == first and env_plugins.RUNS[key] == 1
    # Concurrent retries of the next step: it runs once, every caller gets its answer.
    answers = await asyncio.gather(
        *(step(svc, r.session_id, 1, "", [call("bump", {"key": key})]) for _ in range(4))
    )
    assert all(a == answers[0] for a in answers) and env_plugins.RUNS[key] == 2
    for wrong in (0, 3, 7):  # neither the next (2) nor the last answered (1)
        err = await error_of(step(svc, r.session_id, wrong, "", []))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "expected 2 or 1" in err.details()
    last = await step(svc, r.session_id, 2, "the end")
    assert last.done
    err = await error_of(step(svc, r.session_id, 3, "more"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "episode is over" in err.details()
    assert await step(svc, r.session_id, 2, "the end") == last  # the done step replays
    assert (await close(svc, r.session_id)).reward == 2.0


async def test_tool_refusals_crashes_and_long_answers(svc):
    async with serving(max_tool_output_chars=100) as s:
        r = await reset(s, "test/tools", {})
        calls = [call("picky", {"x": -1}, id="a"), call("boom", id="b"), call("big", {"n": 10_000}, id="c")]
        resp = await step(s, r.session_id, 0, "", calls)
        assert [x.status for x in resp.tool_results] == [
            ST.TOOL_STATUS_INVALID_ARGS,
            ST.TOOL_STATUS_CRASHED,
            ST.TOOL_STATUS_OUTPUT_TRUNCATED,
        ]
        obs = [m.content for m in resp.observations]
        assert obs[0] == "error: x must not be negative, got -1"
        assert obs[1] == "error: boom failed: RuntimeError: the tool exploded"
        assert obs[2].startswith("x" * 100) and obs[2].endswith("(9900 more characters)")
        assert not resp.done


async def test_a_tool_past_its_time_limit_is_timeout_and_ends_the_episode(svc):
    r = await reset(svc, "test/tools", {})
    naps = env_plugins.RUNS.get("nap", 0)
    calls = [call("nap", {"seconds": 0.8}, id="a"), call("bump", {"key": "after-nap"}, id="b")]
    resp = await step(svc, r.session_id, 0, "", calls)
    assert [x.status for x in resp.tool_results] == [ST.TOOL_STATUS_TIMEOUT, ST.TOOL_STATUS_TIMEOUT]
    assert resp.done and not resp.observations  # nothing more runs beside the call left running
    assert "after-nap" not in env_plugins.RUNS
    out = await close(svc, r.session_id)  # waits for the nap to end: the episode is still masked
    assert env_plugins.RUNS["nap"] == naps + 1
    # the model never saw the late answer: no evidence about the policy, never a reward of 0
    assert out.outcome == e.OUTCOME_MASK and out.failure_kind == "tool_timeout" and out.reward == 0.0


# ---- env failures are never a reward -------------------------------------------------------


async def test_env_code_that_raises_or_hangs_is_redo(svc):
    r = await reset(svc, "test/step_raises", {})
    resp = await step(svc, r.session_id, 0, "", [call("anything", id="z")])
    assert resp.done and not resp.observations and resp.tool_results[0].status == ST.TOOL_STATUS_CRASHED
    out = await close(svc, r.session_id)
    assert out.outcome == e.OUTCOME_REDO and out.failure_kind == "env_crashed" and out.reward == 0.0
    assert "RuntimeError: env bug in step" in out.failure_reason

    r = await reset(svc, "test/reward_raises", {})
    await step(svc, r.session_id, 0, "x")
    out = await close(svc, r.session_id)
    assert (
        out.outcome == e.OUTCOME_REDO and out.failure_kind == "env_crashed" and "finite" in out.failure_reason
    )

    r = await reset(svc, "test/masks", {})
    await step(svc, r.session_id, 0, "x")
    out = await close(svc, r.session_id)
    assert (out.outcome, out.failure_kind, out.failure_reason) == (
        e.OUTCOME_MASK,
        "verifier_failed",
        "the verifier is down",
    )

    err = await error_of(reset(svc, "test/reset_raises", {}))
    assert err.code() == grpc.StatusCode.INTERNAL and "crashed in reset: KeyError" in err.details()

    async with serving(step_timeout_seconds=0.3) as s:
        r = await reset(s, "test/step_hangs", {})
        resp = await step(s, r.session_id, 0, "x")
        assert resp.done
        out = await close(s, r.session_id)
        assert out.outcome == e.OUTCOME_REDO and out.failure_kind == "env_timeout"
        assert "ran past its time limit" in out.failure_reason


async def test_a_replica_whose_threads_all_hang_says_so_until_one_comes_back():
    """Env code that overran keeps its thread (a thread cannot be killed). With every thread held
    the replica is NOT_SERVING and its calls UNAVAILABLE (callers go elsewhere: never a reward),
    and serves again once the code returns."""
    async with serving(step_timeout_seconds=0.3, threads=1) as s:
        r = await reset(s, "test/step_hangs", {})
        assert (await step(s, r.session_id, 0, "x")).done  # overran: its thread still sleeps
        health = await s.health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert health.status != SERVING
        err = await error_of(reset(s, episode_id="next"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "restart the replica" in err.details()
        assert counted("relayrl_env_hung_threads", {}) == 1
        for _ in range(100):  # the sleep ends within 1.5 s
            if (await s.health.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == SERVING:
                break
            await asyncio.sleep(0.05)
        out = await close(s, r.session_id)
        assert out.outcome == e.OUTCOME_REDO and out.failure_kind == "env_timeout"
        assert (await step(s, (await reset(s, episode_id="next")).session_id, 0, "56088")).done


# ---- sessions ------------------------------------------------------------------------------


async def test_a_retried_reset_is_the_same_session_and_close_is_idempotent(svc):
    opened = counted("relayrl_env_resets_total", {"env": "calc"})
    first, *others = await asyncio.gather(*(reset(svc, episode_id="same", attempt=0) for _ in range(3)))
    again = await reset(svc, episode_id="same", attempt=0)
    assert again == first and all(o == first for o in others)
    assert counted("relayrl_env_resets_total", {"env": "calc"}) == opened + 1
    other = await reset(svc, episode_id="same", attempt=1)
    assert other.session_id != first.session_id
    assert (await svc.stub.ListEnvs(e.ListEnvsRequest())).open_sessions == 2
    err = await error_of(reset(svc, episode_id="same", attempt=0, seed=9))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "new attempt number" in err.details()
    await step(svc, first.session_id, 0, "56088")
    closed = await close(svc, first.session_id)
    assert await close(svc, first.session_id) == closed and closed.reward == 1.0
    err = await error_of(step(svc, first.session_id, 1, "x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "closed" in err.details()
    # the same ids after Close (an evaluation run again): a new episode, never the closed one
    fresh = await reset(svc, episode_id="same", attempt=0)
    assert fresh.session_id != first.session_id
    assert (await step(svc, fresh.session_id, 0, "56088")).done
    assert (await svc.stub.ListEnvs(e.ListEnvsRequest())).open_sessions == 2  # attempt 1's and this


async def test_max_sessions_is_resource_exhausted():
    async with serving(max_sessions=2) as s:
        a = await reset(s, episode_id="a")
        await reset(s, episode_id="b")
        assert await reset(s, episode_id="a") == a  # a retried Reset takes no new place
        err = await error_of(reset(s, episode_id="c"))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions 2" in err.details()
        await close(s, a.session_id)
        await reset(s, episode_id="c")  # a place is free again


async def test_idle_sessions_expire_after_their_lease():
    before = counted("relayrl_env_sessions_expired_total", {"env": "calc"})
    async with serving(lease_seconds=0.5) as s:
        idle = await reset(s, episode_id="idle")
        busy = await reset(s, "test/tools", {})
        for i in range(5):  # touched every 0.1 s: it stays
            await asyncio.sleep(0.1)
            await step(s, busy.session_id, i, "", [call("bump", {"key": "lease"})])
        await until(
            lambda: counted("relayrl_env_sessions_expired_total", {"env": "calc"}) > before, timeout=5
        )
        err = await error_of(step(s, idle.session_id, 0, "x"))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.details()
        err = await error_of(close(s, idle.session_id))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "lease_seconds" in err.details()
        assert (await close(s, busy.session_id)).outcome == e.OUTCOME_OK
        assert (await s.stub.ListEnvs(e.ListEnvsRequest())).open_sessions == 0
        # A Reset of the expired episode opens a new session.
        assert (await reset(s, episode_id="idle")).session_id != idle.session_id


# ---- bad requests --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rpc", "request_", "code", "problem"),
    [
        (
            "Reset",
            e.ResetRequest(env="nope", episode_id="a", task_json="{}"),
            "INVALID_ARGUMENT",
            "unknown env 'nope'",
        ),
        (
            "Reset",
            e.ResetRequest(env="x" * 10_000, episode_id="a"),
            "INVALID_ARGUMENT",
            "this replica runs: calc",
        ),
        ("Reset", e.ResetRequest(env="calc", task_json="{}"), "INVALID_ARGUMENT", "episode_id is required"),
        (
            "Reset",
            e.ResetRequest(env="calc", episode_id="a" * 257),
            "INVALID_ARGUMENT",
            "episode_id is longer",
        ),
        (
            "Reset",
            e.ResetRequest(env="calc", episode_id="a", task_json="[1]"),
            "INVALID_ARGUMENT",
            "JSON object",
        ),
        (
            "Reset",
            e.ResetRequest(env="calc", episode_id="a", task_json="{x"),
            "INVALID_ARGUMENT",
            "not valid JSON",
        ),
        (
            "Reset",
            e.ResetRequest(env="calc", episode_id="a", task_json=json.dumps({"p": "x" * (1 << 20)})),
            "INVALID_ARGUMENT",
            "task_json is larger than",
        ),
        (
            "Reset",
            e.ResetRequest(env="calc", episode_id="a", task_json='{"prompt": "hi"}'),
            "INVALID_ARGUMENT",
            "refused the task: task has no reward_model.ground_truth",
        ),
        (
            "Reset",
            e.ResetRequest(env="guess", episode_id="a", task_json='{"reward_model": {"ground_truth": 99}}'),
            "INVALID_ARGUMENT",
            "not in 1..63",
        ),
        ("Step", e.StepRequest(session_id="nope"), "NOT_FOUND", "no session 'nope'"),
        ("Step", e.StepRequest(), "INVALID_ARGUMENT", "session_id is required"),
        ("Close", e.CloseRequest(session_id="nope"), "NOT_FOUND", "no session 'nope'"),
        (
            "Step",
            e.StepRequest(session_id="s", action=e.Action(text="x" * (256 * 1024 + 1))),
            "INVALID_ARGUMENT",
            "action.text is larger than",
        ),
        (
            "Step",
            e.StepRequest(session_id="s", action=e.Action(tool_calls=[call("calc")] * 65)),
            "INVALID_ARGUMENT",
            "at most 64",
        ),
        (
            "Step",
            e.StepRequest(session_id="s", action=e.Action(tool_calls=[call("calc", raw="x" * 70_000)])),
            "INVALID_ARGUMENT",
            "action.tool_calls[0].arguments_json is larger than",
        ),
    ],
)
async def test_bad_requests(svc, rpc, request_, code, problem):
    err = await error_of(getattr(svc.stub, rpc)(request_, timeout=10))
    assert err.code() == getattr(grpc.StatusCode, code), err.details()
    assert problem in err.details() and len(err.details()) < 1100


async def test_a_step_on_a_live_session_past_the_bounds_is_refused_and_the_session_goes_on(svc):
    r = await reset(svc)
    err = await error_of(step(svc, r.session_id, 0, "x" * (300 * 1024)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await step(svc, r.session_id, 0, "56088")).done


async def test_a_plugin_that_cannot_load_stops_the_build():
    from relayrl.env.registry import PluginError

    with pytest.raises(PluginError, match="tests.kit.env_plugins:Missing"):
        build(EnvConfig(plugins=["tests.kit.env_plugins:Missing"]))


def test_served_process_runs_episodes_and_exits_zero_on_sigterm(tmp_path):
    from tests.procs import service

    args = [
        "env",
        "--plugin",
        "tests.kit.env_plugins:Counter",
        "--max-sessions",
        "3",
        "--lease-seconds",
        "60",
    ]
    with service(args, tmp_path, timeout=60) as (addr, proc):
        with grpc.insecure_channel(addr) as channel:
            from grpc_health.v1 import health_pb2_grpc

            ready = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert ready.status == SERVING
            stub = env_pb2_grpc.EnvServiceStub(channel)
            listed = stub.ListEnvs(e.ListEnvsRequest(), timeout=10)
            assert listed.max_sessions == 3 and {"calc", "guess", "counter"} <= {x.name for x in listed.envs}
            r = stub.Reset(
                e.ResetRequest(env="calc", task_json=json.dumps(CALC_TASK), episode_id="p"), timeout=10
            )
            action = e.Action(text="", tool_calls=[call("calc", {"expression": "123*456"})])
            obs = stub.Step(e.StepRequest(session_id=r.session_id, step_index=0, action=action), timeout=10)
            assert obs.observations[0].content == "56088" and r.lease_seconds == 60
        assert proc.stop(grace=30) == 0
