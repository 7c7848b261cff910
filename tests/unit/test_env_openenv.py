"""OpenEnv environments on their own servers (``relayrl.env.openenv``), against a real OpenEnv
server (``openenv-core``'s ``create_app``, served by uvicorn on loopback: tests/kit/openenv_guess.py):
the Action's schema is the model's one tool, each call one ``step`` of the episode's own
WebSocket session, the rewards the observations carry are the episode's reward, and what the
model got wrong is answered to it while what the server got wrong is never scored."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from relayrl.env.base import Action, EnvUnavailable, Limits, Outcome, ToolCall, ToolStatus
from relayrl.env.config import EnvConfig, OpenEnvServer
from relayrl.env.openenv import openenv_env
from relayrl.env.registry import PluginError, build_registry

from tests.kit.openenv_guess import serve


@pytest.fixture(scope="module")
def url():
    with serve() as u:
        yield u


@pytest.fixture(scope="module")
def guess(url):
    return openenv_env("guess-openenv", url, 8, "", 10.0)


def call(name: str, args: str, i: int = 0, parse: str = "ok") -> Action:
    return Action("", (ToolCall(f"c{i}", name, args, parse),))


def test_the_action_schema_becomes_the_one_tool(guess):
    (tool,) = guess.tools
    fn = tool["function"]
    assert fn["name"] == "guess" and fn["description"] == "Guess the secret number."
    assert set(fn["parameters"]["properties"]) == {"number"}  # the Action's metadata is not the model's
    assert fn["parameters"]["required"] == ["number"]
    assert fn["parameters"]["properties"]["number"]["maximum"] == 9
    assert guess.expects_tools and guess.max_turns == 8 and guess.name == "guess-openenv"


def test_an_episode_plays_on_the_server_and_is_scored_by_its_rewards(guess):
    env = guess()
    try:
        messages = env.reset({"prompt": "Play.", "secret": 3}, seed=0)
        assert messages == [{"role": "user", "content": "Play.\n\nGuess my number (1-9)."}]
        out, done, results = env.step(call("guess", '{"number": 5}'))
        assert [m["content"] for m in out] == ["Lower."] and not done and results[0].status == ToolStatus.OK
        # An Action the server refuses: the model reads why, and plays on.
        out, done, results = env.step(call("guess", '{"number": 12}', 1))
        assert results[0].status == ToolStatus.INVALID_ARGS and not done
        assert "number" in out[0]["content"] and "less than or equal to 9" in out[0]["content"]
        out, done, results = env.step(call("guess", '{"number": 3}', 2))
        assert out[0]["content"] == "Correct!" and done
        # A call after the end never reaches the server.
        out, done, results = env.step(call("guess", '{"number": 3}', 3))
        assert results[0].status == ToolStatus.CRASHED and "over" in out[0]["content"] and done
        assert env.reward() == (1.0, {"openenv": 1.0, "env_steps": 2.0}, Outcome.OK, "", "")
    finally:
        env.close()


def test_calls_the_model_got_wrong_are_answered_without_a_step(guess):
    env = guess()
    try:
        env.reset({"prompt": "Play.", "secret": 4}, seed=0)
        out, done, results = env.step(call("jump", "{}"))
        assert results[0].status == ToolStatus.UNKNOWN_TOOL and "'guess'" in out[0]["content"]
        out, done, results = env.step(call("guess", '{"number": 4', 1, parse="invalid_json"))
        assert results[0].status == ToolStatus.PARSE_ERROR
        out, done, results = env.step(call("guess", "[4]", 2))
        assert results[0].status == ToolStatus.INVALID_ARGS
        assert env.steps == 0 and not done
        # A turn without calls ends the episode, scored what the env said of it (the reset's 0).
        assert env.step(Action("I give up.")) == ([], True, [])
        assert env.reward() == (0.0, {"openenv": 0.0, "env_steps": 0.0}, Outcome.OK, "", "")
    finally:
        env.close()


def test_a_step_that_raises_in_the_env_is_answered_and_the_episode_goes_on(guess):
    env = guess()
    try:
        env.reset({"prompt": "Play.", "secret": 2, "boom": True}, seed=0)
        out, done, results = env.step(call("guess", '{"number": 7}'))
        assert results[0].status == ToolStatus.CRASHED and "broke on 7" in out[0]["content"] and not done
        out, done, _ = env.step(call("guess", '{"number": 2}', 1))
        assert done and env.reward().reward == 1.0
    finally:
        env.close()


def test_a_long_observation_is_cut_to_the_limit_and_says_so(guess):
    env = guess()
    env.limits = Limits(max_tool_output_chars=4)
    try:
        env.reset({"prompt": "Play.", "secret": 3}, seed=0)
        out, _, results = env.step(call("guess", '{"number": 1}'))
        assert out[0]["content"] == "High" and results[0].status == ToolStatus.OUTPUT_TRUNCATED
    finally:
        env.close()


def test_an_episode_whose_observations_carry_no_reward_is_masked(guess):
    env = guess()
    try:
        env.reset({"prompt": "Play.", "secret": 6, "silent": True}, seed=0)
        _, done, _ = env.step(call("guess", '{"number": 6}'))
        r = env.reward()
        assert done and r.outcome == Outcome.MASK and r.failure_kind == "no_reward"
    finally:
        env.close()


def test_each_episode_has_a_session_of_its_own(guess):
    envs = [guess() for _ in range(8)]
    answers: dict[int, list[str]] = {}

    def play(k: int) -> None:
        envs[k].reset({"prompt": "Play.", "secret": k + 1}, seed=k)
        answers[k] = [envs[k].step(call("guess", f'{{"number": {n}}}', n))[0][0]["content"] for n in (1, 9)]

    threads = [threading.Thread(target=play, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for e in envs:
        e.close()
    assert answers[0] == ["Correct!", "error: the episode is over"]
    assert answers[3] == ["Higher.", "Lower."] and answers[7] == ["Higher.", "Lower."]
    assert answers[8 - 1] != answers[0]


def test_a_server_that_goes_away_mid_episode_is_the_envs_failure_never_a_score():
    with serve() as u:
        cls = openenv_env("guess-openenv", u, 8, "", 10.0)
        env = cls()
        env.reset({"prompt": "Play.", "secret": 5}, seed=0)
    env.limits = Limits(tool_timeout_seconds=5.0)
    with pytest.raises(EnvUnavailable, match="OpenEnv server"):
        env.step(call("guess", '{"number": 1}'))
    env.close()
    with pytest.raises(EnvUnavailable, match="cannot open a session"):
        cls().reset({"prompt": "Play."}, seed=0)


def test_a_server_that_does_not_answer_stops_the_replica_naming_it():
    with socket.socket() as s:  # a loopback port with nothing behind it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = EnvConfig(
        openenv=[{"name": "far", "url": f"http://127.0.0.1:{port}", "connect_timeout_seconds": 2}]
    )
    with pytest.raises(PluginError, match=rf"openenv far: OpenEnv server http://127.0.0.1:{port}: no schema"):
        build_registry([], openenv=cfg.openenv)


def test_the_registry_serves_it_beside_the_builtins(url):
    specs = build_registry([], openenv=[OpenEnvServer(name="guess-openenv", url=url)])
    assert specs["guess-openenv"].origin == url and "calc" in specs and "guess" in specs
    with pytest.raises(PluginError, match="already served"):
        build_registry(
            ["tests.kit.trl_envs:IncrementEnv"], openenv=[OpenEnvServer(name="incrementenv", url=url)]
        )


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"openenv": [{"name": "a", "url": "ftp://x"}]}, "url"),
        ({"openenv": [{"name": "a b", "url": "http://x"}]}, "name"),
        (
            {"openenv": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]},
            "names must differ",
        ),
        ({"openenv": [{"name": "a", "url": "http://x", "max_turns": 0}]}, "max_turns"),
    ],
)
def test_bad_openenv_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EnvConfig(**bad)


@pytest.fixture(scope="module")
def mcp_url():
    from tests.kit.openenv_mcp import serve_mcp

    with serve_mcp() as u:
        yield u


def test_an_mcp_environment_offers_its_own_tools_each_call_a_call_tool_step(mcp_url):
    """openenv-core 0.3's MCPEnvironment (FastMCP tools), served as OpenEnv's docs serve it: its
    tools are the model's, named and described by the server; what the tool raises, arguments it
    refuses and a tool it does not have are answered to the model; submit's reward scores."""
    (spec,) = [
        s
        for s in build_registry([], openenv=[OpenEnvServer(name="mcp-calc", url=mcp_url)]).values()
        if s.from_plugin
    ]
    cls = spec.cls
    assert cls.mcp and [t["function"]["name"] for t in cls.tools] == ["calc", "submit"]
    calc = cls.tools[0]["function"]
    assert calc["description"].startswith("Evaluate an arithmetic expression")
    assert calc["parameters"]["required"] == ["expression"] and "title" not in json.dumps(calc["parameters"])
    env = cls()
    env.limits = Limits(tool_timeout_seconds=30.0)
    try:
        messages = env.reset({"prompt": "What is 12 * 34?", "answer": "408"}, seed=0)
        assert messages == [{"role": "user", "content": "What is 12 * 34?"}]
        out, done, results = env.step(call("calc", '{"expression": "12 * 34"}'))
        assert out[0]["content"] == "408" and results[0].status == ToolStatus.OK and not done
        out, done, results = env.step(call("calc", '{"expression": "import os"}', 1))
        assert results[0].status == ToolStatus.CRASHED and "not an arithmetic expression" in out[0]["content"]
        out, done, results = env.step(call("calc", '{"expr": "1"}', 2))
        assert results[0].status == ToolStatus.INVALID_ARGS and "expression" in out[0]["content"] and not done
        out, done, results = env.step(call("answer", '{"answer": "408"}', 3))  # never reaches the server
        assert results[0].status == ToolStatus.UNKNOWN_TOOL and "'calc', 'submit'" in out[0]["content"]
        assert env.steps == 3
        out, done, results = env.step(call("submit", '{"answer": "408"}', 4))
        assert out[0]["content"] == "submitted 408" and done
        reward = env.reward()
        assert reward.outcome == Outcome.OK and reward.reward == 1.0 and reward.components["env_steps"] == 4
    finally:
        env.close()
    wrong = cls()
    wrong.limits = Limits(tool_timeout_seconds=30.0)
    try:
        wrong.reset({"prompt": "What is 12 * 34?", "answer": "408"}, seed=1)
        _, done, _ = wrong.step(call("submit", '{"answer": "407"}'))
        assert done and wrong.reward().outcome == Outcome.OK and wrong.reward().reward == 0.0
    finally:
        wrong.close()


def test_an_mcp_tool_list_past_its_bounds_is_refused_naming_why():
    """The server's tool list goes into every prompt: it is refused whole, never cut or crashed on."""
    from relayrl.env.openenv_mcp import MAX_MCP_TOOLS, mcp_tools

    def tool(name="calc", schema=None):
        return {"name": name, "description": "d", "input_schema": schema or {"type": "object"}}

    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}}
    cases = [
        ([], "gave 0 tools"),
        ([tool(f"t{i}") for i in range(MAX_MCP_TOOLS + 1)], f"gave {MAX_MCP_TOOLS + 1} tools"),
        ([tool("a.b")], "plain name"),
        ([tool("a"), tool("a")], "named a tool twice: a"),
        ([tool(schema={"type": "object", "description": "x" * 20_000})], "input schema is over"),
        ([tool(schema=deep)], "nested deeper than 32 levels"),
        (
            [tool(f"t{i}", {"type": "object", "description": "x" * 15_000}) for i in range(20)],
            "characters of tools",
        ),
        ("not a list", "gave no tools"),
    ]
    for listed, why in cases:
        with pytest.raises(ValueError, match=why):
            mcp_tools(listed)
