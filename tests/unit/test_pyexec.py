"""The ``pyexec`` env: calc's task with a ``python(code)`` tool run in the sandbox.

What is checked: the program's stdout is the model's observation and the reward is calc's; a
program that fails (an exception, its time or memory limit) is an observation with its verdict
and the episode goes on; a sandbox that cannot run (``SandboxUnavailable``), or a replica
without one, ends the episode REDO through the session table, never a reward. A stand-in
sandbox answers most tests (no processes); one test runs the real one.
"""

from __future__ import annotations

import json

import pytest
from relayrl.common.sandbox import RunResult, SandboxUnavailable, Verdict
from relayrl.env.base import Action, EnvUnavailable, Outcome, ToolCall, ToolStatus
from relayrl.env.config import EnvConfig
from relayrl.env.pyexec import PyExecEnv
from relayrl.env.registry import EnvSpec
from relayrl.env.sessions import SessionTable

TASK = {
    "prompt": [{"role": "user", "content": "What is 123 * 456? End with the answer as a number."}],
    "reward_model": {"ground_truth": "56088"},
    "data_source": "calc",
}


class StandIn:
    """A sandbox that answers from a table of programs (or raises what it is given)."""

    def __init__(self, answers: dict[str, RunResult | Exception]):
        self.answers, self.ran = answers, []

    def run_sync(self, code: str, stdin: str = "", limits=None, files=None, deadline=None) -> RunResult:
        self.ran.append(code)
        answer = self.answers[code]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _ok(stdout: str) -> RunResult:
    return RunResult(Verdict.OK, 0, None, stdout, "", 0.03, False)


def _call(code: str, i: int = 0) -> Action:
    return Action("", (ToolCall(f"c{i}", "python", json.dumps({"code": code})),))


def _env(answers) -> PyExecEnv:
    env = PyExecEnv()
    env.sandbox = StandIn(answers)
    return env


def test_the_program_prints_the_observation_and_the_reward_is_calcs():
    env = _env({"print(123 * 456)": _ok("56088\n")})
    first = env.reset(TASK, 0)
    assert first[0]["role"] == "system" and "python" in first[0]["content"]
    assert [t["function"]["name"] for t in PyExecEnv.tools] == ["python"]
    obs, done, results = env.step(_call("print(123 * 456)"))
    assert not done and results[0].status == ToolStatus.OK
    assert obs == [{"role": "tool", "content": "56088\n", "tool_call_id": "c0", "name": "python"}]
    assert env.step(Action("The answer is 56088."))[1]
    r = env.reward()
    assert r.reward == 1.0 and r.outcome == Outcome.OK
    assert r.components == {"correctness": 1.0, "tool_calls": 1.0, "turns": 2.0}


@pytest.mark.parametrize(
    "result, status, says",
    [
        (
            RunResult(
                Verdict.CRASHED,
                1,
                None,
                "",
                "Traceback ...\nNameError: name 'x' is not defined\n",
                0.04,
                False,
            ),
            ToolStatus.CRASHED,
            "NameError: name 'x' is not defined",
        ),
        (RunResult(Verdict.TIMEOUT, None, 9, "", "", 5.0, False), ToolStatus.CRASHED, "time limit"),
        (
            RunResult(Verdict.MEMORY, 1, None, "", "MemoryError\n", 0.2, False),
            ToolStatus.CRASHED,
            "out of memory",
        ),
        (RunResult(Verdict.KILLED, None, 11, "", "", 0.1, False), ToolStatus.CRASHED, "signal 11"),
        (
            RunResult(Verdict.OUTPUT_TRUNCATED, None, 9, "7" * 65536, "", 0.3, True),
            ToolStatus.OUTPUT_TRUNCATED,
            "more characters",
        ),
    ],
)
def test_a_program_that_fails_is_an_observation_and_the_episode_goes_on(result, status, says):
    env = _env({"bad": result, "print(123 * 456)": _ok("56088\n")})
    env.reset(TASK, 0)
    obs, done, results = env.step(_call("bad"))
    assert not done and results[0].status == status
    assert says in obs[0]["content"] and len(obs[0]["content"]) < 3000
    assert not env.tool_timed_out  # answered: the model saw it, so the episode trains
    obs, done, _ = env.step(_call("print(123 * 456)", 1))  # the model fixes its program
    assert obs[0]["content"] == "56088\n" and not done


def test_bad_arguments_never_reach_the_sandbox():
    env = _env({})
    env.reset(TASK, 0)
    for code in ("", "   ", "x" * 5000):
        obs, done, results = env.step(_call(code))
        assert results[0].status == ToolStatus.INVALID_ARGS and not done
    assert env.sandbox.ran == []


def test_a_sandbox_that_cannot_run_is_not_an_observation():
    env = _env({"print(1)": SandboxUnavailable("bwrap: setting up uid map: Permission denied")})
    env.reset(TASK, 0)
    with pytest.raises(EnvUnavailable, match="uid map") as caught:
        env.step(_call("print(1)"))
    assert caught.value.kind == "sandbox_unavailable"
    with pytest.raises(EnvUnavailable):
        PyExecEnv().reset(TASK, 0)  # a replica without a sandbox


async def _episode(sandbox) -> tuple[object, object]:
    """Reset, one python call, Close through a session table whose envs get ``sandbox``."""
    table = SessionTable(
        {"pyexec": EnvSpec("pyexec", PyExecEnv, "relayrl.env.pyexec:PyExecEnv", False)}, EnvConfig()
    )
    table.sandbox = sandbox
    opened = await table.open("pyexec", TASK, 0, "ep", 0, 5.0)
    out = await table.step(opened.session_id, 0, _call("print(123 * 456)"), 5.0)
    return out, await table.close(opened.session_id, 5.0)


async def test_the_session_table_redoes_an_episode_whose_sandbox_failed():
    out, reward = await _episode(StandIn({"print(123 * 456)": SandboxUnavailable("no bwrap")}))
    assert out.done and out.observations == []
    assert reward.outcome == Outcome.REDO and reward.failure_kind == "sandbox_unavailable"
    assert "no bwrap" in reward.failure_reason


async def test_the_session_table_hands_its_sandbox_to_the_env():
    out, reward = await _episode(StandIn({"print(123 * 456)": _ok("56088\n")}))
    assert out.observations[0]["content"] == "56088\n" and not out.done
    assert reward.outcome == Outcome.OK  # no final answer: 0, a real reward


def test_the_real_sandbox_runs_the_models_program():
    from relayrl.common.sandbox import Sandbox, SandboxConfig

    env = PyExecEnv()
    env.sandbox = Sandbox.from_config(SandboxConfig(workers=1))
    env.reset(TASK, 0)
    obs, _, results = env.step(_call("import math\nprint(math.prod([123, 456]))"))
    assert (obs[0]["content"], results[0].status) == ("56088\n", ToolStatus.OK)
    obs, _, results = env.step(_call("print(open('/etc/shadow').read())", 1))
    assert results[0].status == ToolStatus.CRASHED and "Error" in obs[0]["content"]


async def test_abandoned_programs_never_delay_a_fresh_call():
    """Issue 39: a dozen sessions whose ``sleep(60)`` calls timed out (their programs queued on
    the replica's 2 workers, or running) must not make an innocent ``print(6*7)`` of another
    session time out: each job carries its call's deadline, so what its caller gave up is
    dropped unstarted or killed at once. Before, they queued and ran to their own 5 s wall limit
    (12 jobs / 2 workers = 30 s), and the fresh call timed out and masked its episode."""
    import asyncio
    import time

    from relayrl.common.sandbox import Sandbox, SandboxConfig

    table = SessionTable(
        {"pyexec": EnvSpec("pyexec", PyExecEnv, "relayrl.env.pyexec:PyExecEnv", False)},
        EnvConfig(tool_timeout_seconds=2.0, threads=32),
    )
    table.sandbox = Sandbox.from_config(SandboxConfig(workers=2))
    try:
        opened = [await table.open("pyexec", TASK, 0, f"ep{i}", 0, 5.0) for i in range(13)]
        slow = [table.step(o.session_id, 0, _call("import time\ntime.sleep(60)"), 5.0) for o in opened[:12]]
        outs = await asyncio.gather(*slow)
        for o in outs:  # the call's limit, or the job killed at it a moment before: both say so
            assert o.tool_results[0].status in (ToolStatus.TIMEOUT, ToolStatus.CRASHED)
            assert "time limit" in o.observations[0]["content"] if o.observations else True
        start = time.monotonic()
        out = await table.step(opened[12].session_id, 0, _call("print(6*7)"), 5.0)
        took = time.monotonic() - start  # within its 2 s tool limit, or it would be a TIMEOUT
        assert out.tool_results[0].status == ToolStatus.OK, f"the fresh call: {out} after {took:.2f}s"
        assert out.observations[0]["content"] == "42\n"
        closes = await asyncio.gather(*(table.close(o.session_id, 5.0) for o in opened[:12]))
        assert Outcome.REDO not in {r.outcome for r in closes}
        assert all(table.ended[o.session_id].env is None for o in opened[:12])  # freed at once
    finally:
        table.sandbox.close()
        await table.shutdown()


# ---- through the env service ---------------------------------------------------------------


async def _served(config: EnvConfig, calls: list[str]):
    """Reset a pyexec episode on a real replica, make ``calls``, answer 56088; (observations, Close)."""
    import grpc
    from relayrl.common.grpc_server import start
    from relayrl.common.v1 import common_pb2 as c
    from relayrl.env.server import build
    from relayrl.env.v1 import env_pb2 as e
    from relayrl.env.v1 import env_pb2_grpc

    from tests.kit.serving import client

    handle = build(config)
    await start(handle, ready=True)
    try:
        async with client(handle, env_pb2_grpc.EnvServiceStub) as s:
            req = e.ResetRequest(env="pyexec", task_json=json.dumps(TASK), episode_id="ep/pyexec")
            try:
                r = await s.stub.Reset(req, timeout=10)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
            seen = []
            for i, code in enumerate(calls):
                tool_call = c.ToolCall(
                    id=f"c{i}", name="python", arguments_json=json.dumps({"code": code}), parse=1
                )
                action = e.Action(tool_calls=[tool_call], finish_reason=c.FINISH_REASON_STOP)
                out = await s.stub.Step(
                    e.StepRequest(session_id=r.session_id, step_index=i, action=action), timeout=20
                )
                seen.append(
                    [(m.content, x.status) for m, x in zip(out.observations, out.tool_results, strict=True)]
                )
            final = e.Action(text="The answer is 56088.", finish_reason=c.FINISH_REASON_STOP)
            await s.stub.Step(
                e.StepRequest(session_id=r.session_id, step_index=len(calls), action=final), timeout=10
            )
            return seen, await s.stub.Close(e.CloseRequest(session_id=r.session_id), timeout=10)
    finally:
        await handle.stop(0)


async def test_a_replica_serves_pyexec_on_request_with_its_sandbox():
    from relayrl.env.v1 import env_pb2 as e

    config = EnvConfig(plugins=["relayrl.env.pyexec:PyExecEnv"], sandbox={"workers": 1})
    seen, closed = await _served(config, ["print(123 * 456)", "print(1 / 0)"])
    ok, crashed = e.ToolStatus.TOOL_STATUS_OK, e.ToolStatus.TOOL_STATUS_CRASHED
    assert seen[0] == [("56088\n", ok)]
    assert seen[1][0][1] == crashed and "ZeroDivisionError" in seen[1][0][0]  # the model's: it goes on
    assert closed.outcome == e.OUTCOME_OK and closed.reward == 1.0
    assert dict(closed.components) == {"correctness": 1.0, "tool_calls": 2.0, "turns": 3.0}


async def test_a_replica_that_does_not_serve_pyexec_says_how():
    import grpc

    code, details = await _served(EnvConfig(), [])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "relayrl.env.pyexec:PyExecEnv" in details
