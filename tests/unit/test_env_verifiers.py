"""verifiers environments (``env.verifiers``, ``relayrl.env.verifiers``): config checks, how a row
names its task, what a rollout's report becomes; then verifiers 0.4 itself in the sandbox, its
rollout through the real gateway on a scripted model (``tests/kit/agent_stack.py``): its own
tool server, its own rubric, one gateway session per rollout, the trained tokens the sampled ones.
A run's data listed from a taskset, and a run that trains on one: test_env_standards.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from relayrl.common.sandbox import RunResult, Verdict
from relayrl.env.base import Action, GatewayEndpoint, Outcome, TaskError
from relayrl.env.config import EnvConfig, VerifiersEnvSpec
from relayrl.env.verifiers import VerifiersEnv, env_data, verifiers_env

from tests.kit.agent_wheels import agent_wheels, offline

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "tests" / "kit" / "verifiers_envs"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _spec(**kw) -> VerifiersEnvSpec:
    return VerifiersEnvSpec(**{"name": "calc-vf", "taskset": "calc_vf", "folder": str(KIT), **kw})


def test_a_spec_names_what_it_lacks():
    with pytest.raises(ValueError, match="folder"):
        VerifiersEnvSpec(name="x", taskset="t", folder="/nonexistent/here")
    with pytest.raises(ValueError, match="requirements"):
        VerifiersEnvSpec(name="x", taskset="t", requirements="/nonexistent/reqs.txt")
    with pytest.raises(ValueError, match="taskset"):
        VerifiersEnvSpec(name="x", taskset="not a module")
    cfg = EnvConfig(verifiers=[{"name": "x", "taskset": "mod.sub", "max_turns": 3}])
    assert env_data(cfg.verifiers[0]) == {"taskset": {"id": "mod.sub"}, "agent": {"max_turns": 3}}


def test_data_generate_names_an_env_of_env_verifiers():
    from relayrl.coordinator.config import ExperimentConfig

    base = {
        "name": "v",
        "model": {"path": "/m"},
        "data": {"train": "/t.jsonl", "generate": {"task": "verifiers/calc-vf", "n_train": 4, "n_test": 0}},
        "episodes": {"env": "calc-vf"},
        "services": {"gateway_replicas": 1},
    }
    with pytest.raises(ValueError, match="env.verifiers has no env named 'calc-vf'"):
        ExperimentConfig.model_validate(base)
    ok = ExperimentConfig.model_validate({**base, "env": {"verifiers": [_spec().model_dump()]}})
    assert ok.data.generate.task == "verifiers/calc-vf"
    with pytest.raises(ValueError, match="taskset_args"):
        ExperimentConfig.model_validate(
            {**base, "data": {**base["data"], "generate": {**base["data"]["generate"], "params": {"x": 1}}}}
        )


def _env(**kw) -> VerifiersEnv:
    env = verifiers_env(_spec(**kw))()
    env.sandbox, env.gateway = object(), GatewayEndpoint("http://127.0.0.1:1/v1", "k", "m")
    return env


def test_a_row_names_its_task_by_index_or_id_and_nothing_else():
    env = _env()
    assert env.reset({"prompt": "What?", "task_index": 3}, 0) == [{"role": "user", "content": "What?"}]
    assert env.agent_input() == {"env": env_data(env.spec), "task": {"index": 3}, "model": "m"}
    env = _env()
    env.reset({"task_id": "calc-0"}, 0)
    assert env.agent_input()["task"] == {"id": "calc-0"}
    for bad in ({"task_index": -1}, {"task_index": True}, {"task_id": ""}, {"prompt": "x"}):
        with pytest.raises(TaskError, match="task_index"):
            _env().reset(bad, 0)


def _ran(stdout: str, code: int = 0) -> RunResult:
    return RunResult(Verdict.OK, code, None, stdout, "boom" if code else "", 0.1, False)


def test_the_rubrics_reward_is_the_episodes_and_a_rollout_without_one_is_masked():
    env = _env()
    env.reset({"task_index": 0}, 0)
    env.ran = True
    report = {
        "final": "408",
        "turns": 2,
        "tool_calls": 1,
        "truncated": False,
        "reward": 0.5,
        "rewards": {"a": 0.5},
    }
    env._judge(_ran("log line\n" + json.dumps(report)), 10.0)
    assert env.reward() == (0.5, {"a": 0.5}, Outcome.OK, "", "")
    for stdout, code in (
        (json.dumps({**report, "reward": float("nan")}), 0),  # json writes NaN, read back as nan
        (json.dumps({**report, "rewards": {"a": "x"}}), 0),
        (json.dumps(report), 2),  # verifiers ended the rollout with errors: exit 2, no score
        ("no report", 0),
    ):
        env = _env()
        env.reset({"task_index": 0}, 0)
        env.ran = True
        env._judge(_ran(stdout, code), 10.0)
        got = env.reward()
        assert got.outcome == Outcome.MASK and got.failure_kind == "agent_failed", (stdout, got)


@pytest.fixture(scope="module")
def offline_requirements(tmp_path_factory) -> Path:
    """verifiers from the wheels test.sh fetched, nothing from the network."""
    path = tmp_path_factory.mktemp("vf") / "requirements.txt"
    path.write_text(offline(agent_wheels(KIT / "requirements.txt")) + (KIT / "requirements.txt").read_text())
    return path


@needs_bwrap
def test_a_verifiers_rollout_runs_in_the_sandbox_through_the_gateway_one_session_each(offline_requirements):
    """calc_vf (a tool on its own MCP server, a reward of its own) played twice by relayrl's chat
    harness on a scripted model that calls calc and answers: each rollout its own gateway
    session, scored 1 by the environment's rubric, its one segment the tokens sampled."""
    from relayrl.common.sandbox import Sandbox

    from tests.kit.agent_stack import segments_are_the_sampled_tokens, stack

    cls = verifiers_env(_spec(requirements=str(offline_requirements)))
    box = Sandbox("full", workers=2)

    async def play(s, pid: str):
        opened = await s.open(pid)
        env = cls()
        env.sandbox = box
        env.gateway = GatewayEndpoint(f"http://127.0.0.1:{s.port}/v1", opened.session_key, opened.model)
        env.reset({"prompt": "What is 12 * 34? Use the calc tool.", "task_index": 0}, 0)
        await asyncio.to_thread(env.step, Action(""))
        return env, env.reward(), await s.close(opened.session_key)

    async def both():
        async with stack() as s:  # two rollouts at once, each its own session
            return await asyncio.gather(play(s, "p/0"), play(s, "p/1")), s.engine

    try:
        cls.prepare(box)  # as the env service does before serving: verifiers' ~100 wheels, once
        results, engine = asyncio.run(both())
    finally:
        box.close()
    for env, reward, closed in results:
        assert env.failure is None, env.failure
        assert reward == (1.0, {"right_number": 1.0}, Outcome.OK, "", ""), reward
        assert closed.calls == 2 and closed.history_breaks == 0 and len(closed.segments) == 1
        segments_are_the_sampled_tokens(closed, engine)
    assert len(engine.sampled) == 4  # 2 calls x 2 rollouts, none shared
