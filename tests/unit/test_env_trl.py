"""TRL's environment classes in the env service, as TRL documents them (``tests/kit/trl_envs.py``):
the class named in ``env.plugins``, scored by its own ``get_reward`` and by the reward functions
named in ``env.reward_funcs`` (``reward_func(environments, **kwargs)``, weighted by
``env.reward_weights``), called as ``GRPOTrainer`` calls them; tools are its bound public methods.
An episode no function scores is masked, never a 0; bad configs are refused naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from relayrl.env.config import EnvConfig
from relayrl.env.registry import PluginError, build_registry
from relayrl.env.v1 import env_pb2 as e

from tests.unit.test_env_service import call, close, reset, serving, step

PLUGINS = ["tests.kit.trl_envs:IncrementEnv", "tests.kit.trl_envs:GuessEnv"]
FUNCS = ["tests.kit.trl_envs:reward_func", "tests.kit.trl_envs:brevity"]


async def test_the_documented_increment_env_scores_itself():
    async with serving(plugins=["tests.kit.trl_envs:IncrementEnv"]) as svc:
        r = await reset(svc, "incrementenv", {"prompt": [{"role": "user", "content": "Go. "}], "seed": 3})
        target = int(r.messages[-1].content.split("by ")[-1].rstrip("."))
        assert r.messages[-1].content == f"Go. Increment the counter by {target}."  # reset's text appended
        first = await step(svc, r.session_id, 0, "", [call("increment", {"step": target - 1})])
        assert first.observations[0].content == str(target - 1)
        await step(svc, r.session_id, 1, "", [call("increment", {"step": 1})])
        assert (await step(svc, r.session_id, 2, "Done.")).done
        out = await close(svc, r.session_id)
    assert out.outcome == e.OUTCOME_OK and out.reward == 1.0 and out.components["IncrementEnv"] == 1.0


async def test_reward_functions_receive_the_environments_and_the_rows_columns():
    async with serving(
        plugins=["tests.kit.trl_envs:GuessEnv"], reward_funcs=FUNCS, reward_weights=[1.0, 2.0]
    ) as svc:
        r = await reset(svc, "guessenv", {"prompt": [{"role": "user", "content": "Play."}], "secret": 7})
        assert r.messages[-1].content == "Play. Guess my number (1-9)."
        assert '"guess"' in r.tools_json and "helper" not in r.tools_json  # bound methods only
        a = await step(svc, r.session_id, 0, "", [call("guess", {"number": 3})])
        assert a.observations[0].content == "Higher."
        b = await step(
            svc, r.session_id, 1, "", [call("guess", {"number": 7}), call("guess", {"number": 7}, id="c2")]
        )
        assert [m.content for m in b.observations][0] == "Correct!"
        assert "Game over." in b.observations[1].content and b.observations[1].content.startswith("error:")
        await step(svc, r.session_id, 2, "It is 7.")
        out = await close(svc, r.session_id)
    # reward_func: env.reward = 1; brevity: 0.5 / 3 assistant turns, weight 2.
    assert out.outcome == e.OUTCOME_OK
    assert out.reward == pytest.approx(1.0 + 2 * 0.5 / 3)
    assert out.components["reward_func"] == 1.0 and out.components["brevity"] == pytest.approx(0.5 / 3)


async def test_an_episode_no_function_scores_is_masked_not_zero():
    async with serving(
        plugins=["tests.kit.trl_envs:GuessEnv"], reward_funcs=["tests.kit.trl_envs:brevity"]
    ) as svc:
        r = await reset(svc, "guessenv", {"prompt": "Play.", "secret": None})
        await step(svc, r.session_id, 0, "No.")
        out = await close(svc, r.session_id)
    assert out.outcome == e.OUTCOME_MASK and out.failure_kind == "no_reward"


def test_trl_configs_that_cannot_work_are_refused_naming_why():
    with pytest.raises(PluginError, match="no get_reward and the env config names no reward_funcs"):
        build_registry(["tests.kit.trl_envs:GuessEnv"])
    with pytest.raises(PluginError, match="cannot|AttributeError"):
        build_registry(["tests.kit.trl_envs:GuessEnv"], ["tests.kit.trl_envs:no_such_function"])
    for bad in (
        {"reward_funcs": ["nocolon"]},
        {"reward_funcs": ["a:b"], "reward_weights": [1.0, 2.0]},
        {"reward_funcs": ["a:b"], "reward_weights": [float("nan")]},
    ):
        with pytest.raises(ValidationError, match="reward_"):
            EnvConfig(**bad)
