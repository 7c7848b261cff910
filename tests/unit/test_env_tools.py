"""The env service's pure parts: calc's evaluator (never ``eval``), tool schemas and calls,
plugin loading, the config and ``relayrl serve env`` flags."""

from __future__ import annotations

import argparse
import json
from typing import Literal

import pytest
from pydantic import ValidationError
from relayrl.env.base import Limits, ToolCall, ToolStatus
from relayrl.env.calc import MAX_EXPRESSION_CHARS, evaluate
from relayrl.env.config import EnvConfig
from relayrl.env.registry import PluginError, build_registry, load_plugin
from relayrl.env.tools import answer_call, function_schema, run_tools


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123 * 456", 56088),
        ("-3 + +4", 1),
        ("2 ** 10 - 1", 1023),
        ("(7 - 2) * (3 + 1) // 3 % 4", 2),
        ("1 / 4", 0.25),
        ("2 ** -1", 0.5),
        ("1_000 * 3", 3000),
        ("  12  ", 12),
        ("10 ** 100", 10**100),
    ],
)
def test_evaluator_computes_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("x + 1", "names are not allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("().__class__", "attributes are not allowed"),
        ("[1, 2]", "List are not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("9 ** 9 ** 9", "exponent 387420489 is too large"),
        ("2 ** 1000", "too large"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("1e308 * 10", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 if 1 else 2", "IfExp are not allowed"),
        ("1 < 2", "Compare are not allowed"),
        ("2 ^ 3", "BinOp are not allowed"),
        ("lambda: 1", "Lambda are not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("123 * 456 =", "not an arithmetic expression"),
        ("", "empty"),
        ("1+" * 60 + "1", "more than 100 parts"),
        ("-" * 400 + "1", "more than 100 parts"),
        ("1" * (MAX_EXPRESSION_CHARS + 1), "longer than"),
    ],
)
def test_evaluator_refuses_everything_else(expression, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")) as e:
        evaluate(expression)
    assert len(str(e.value)) < 200


def test_evaluator_never_calls_eval(monkeypatch):
    import builtins

    def no(*a, **k):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", no)
    monkeypatch.setattr(builtins, "exec", no)
    assert evaluate("6 * 7") == 42


def test_function_schema_from_hints_and_docstring():
    def search(
        query: str, limit: int = 5, mode: Literal["fast", "full"] = "fast", tags: list[str] | None = None
    ):
        """Search the notes.

        Longer text goes on.

        Args:
            query: words to look for,
                over two lines
            limit (int): most results
        Returns:
            the matches
        """

    f = function_schema(search)["function"]
    assert f["name"] == "search" and f["description"] == "Search the notes. Longer text goes on."
    props = f["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "words to look for, over two lines"}
    assert props["limit"] == {"type": "integer", "description": "most results"}
    assert props["mode"] == {"type": "string", "enum": ["fast", "full"]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert f["parameters"]["required"] == ["query"]


def test_tool_answers_are_bounded_and_never_raise():
    def echo(text: str) -> str:
        return text

    def fail(text: str) -> str:
        raise ValueError("bad: " + text)

    tools, limits = {"echo": echo, "fail": fail}, Limits(1.0, 50)
    huge = "y" * 100_000
    calls = [
        ToolCall("1", "echo", json.dumps({"text": huge})),
        ToolCall("2", "fail", json.dumps({"text": huge})),
        ToolCall("3", "n" * 5000, "{}"),
        ToolCall("4", "", huge, parse="invalid_json"),
        ToolCall("5", "echo", json.dumps({"text": 1, "extra": 2})),
    ]
    messages, results = run_tools(calls, tools, limits, None, [])
    assert [r.status for r in results] == [
        ToolStatus.OUTPUT_TRUNCATED,
        ToolStatus.INVALID_ARGS,
        ToolStatus.UNKNOWN_TOOL,
        ToolStatus.PARSE_ERROR,
        ToolStatus.INVALID_ARGS,
    ]
    assert all(len(m["content"]) < 700 for m in messages)
    assert all(len(r.name) <= 128 for r in results)


def test_a_call_with_no_time_left_is_not_run():
    ran = []
    text, status = answer_call(ToolCall("1", "f"), {"f": lambda: ran.append(1)}, Limits(), 0.0, [])
    assert status == ToolStatus.TIMEOUT and not ran and "time is up" in text


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("tests.kit.no_such_module:X", "cannot load: ModuleNotFoundError"),
        ("tests.kit.env_plugins:Nope", "cannot load: AttributeError"),
        ("tests.kit.env_plugins:RUNS", "not an Env subclass nor a TRL environment class"),
        ("relayrl.env.base:Env", "name must be a non-empty string"),
    ],
)
def test_plugins_that_cannot_load(ref, problem):
    with pytest.raises(PluginError, match=problem):
        load_plugin(ref)


def test_registry_builtins_plugins_and_clashes():
    specs = build_registry(["tests.kit.env_plugins:Tools", "tests.kit.env_plugins:Counter"])
    assert {"calc", "guess", "test/tools", "counter"} <= set(specs)
    assert specs["test/tools"].from_plugin and not specs["calc"].from_plugin
    with pytest.raises(PluginError, match="already served by tests.kit.env_plugins:Tools"):
        build_registry(["tests.kit.env_plugins:Tools", "tests.kit.env_plugins:Tools"])


def test_config_bounds_and_plugin_refs():
    assert EnvConfig().max_sessions == 1024 and EnvConfig().lease_seconds == 1800
    for bad in ({"plugins": ["nocolon"]}, {"max_sessions": 0}, {"lease_seconds": 0}, {"surprise": 1}):
        with pytest.raises(ValidationError):
            EnvConfig(**bad)


def test_serve_env_flags_build_the_config():
    from relayrl import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "serve",
            "env",
            "--plugin",
            "a.b:C",
            "--plugin",
            "d:E",
            "--max-sessions",
            "7",
            "--lease-seconds",
            "2.5",
        ]
    )
    config = serve_cli.build_config(args)
    assert isinstance(config, EnvConfig)
    assert (config.plugins, config.max_sessions, config.lease_seconds) == (["a.b:C", "d:E"], 7, 2.5)


def test_reward_answers_are_checked_and_bounded():
    from relayrl.env.base import Outcome, Reward
    from relayrl.env.sessions import check_reward

    r = check_reward(Reward(0.0, {}, "redo", "", "z" * 5000))
    assert r.outcome == Outcome.REDO and r.failure_kind == "env_redo" and len(r.failure_reason) <= 1024
    assert check_reward(1) == Reward(1.0) and check_reward(Reward(0.5, {"a": 1})).components == {"a": 1.0}
    bad = [float("nan"), "x", Reward(True), Reward(1.0, {"a": float("inf")}), Reward(1.0, {}, "maybe")]
    for answer in bad:
        with pytest.raises((TypeError, ValueError)):
            check_reward(answer)
