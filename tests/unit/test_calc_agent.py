"""The scripted calc agent (``relayrl.env.agents.calc_agent``) in-process, against a fake OpenAI
server on 127.0.0.1.

What is checked: it plays calc (a tool call answered with calc's result, then the final answer),
sending the model name, the bearer key, the tools and the assistant message as returned; its tool
answers are worded exactly as ``CalcEnv`` (a ``ToolEnv``) words them; a reply cut at its budget or
a context that is full ends the episode cut; a 429 is waited out; it makes at most ``max_turns``
requests; any other HTTP error is exit status 3 with the error on stderr and no report.
"""

from __future__ import annotations

import io
import json

import pytest
from relayrl.env.agents import calc_agent
from relayrl.env.base import Action, ToolCall
from relayrl.env.calc import CalcEnv

from tests.kit.openai_fake import FakeOpenAI, answer, error, tool_calls

START = [
    {"role": "system", "content": CalcEnv.SYSTEM},
    {"role": "user", "content": "What is 123 * 456?"},
]


def _play(replies, max_turns=4):
    with FakeOpenAI(replies) as fake:
        client = calc_agent.Client(fake.url, "sk-test", "tiny-qwen", timeout=10)
        report = calc_agent.play({"messages": START, "tools": CalcEnv.tools, "max_turns": max_turns}, client)
    return report, fake.requests


def test_plays_calc_with_a_tool_call_then_an_answer():
    report, requests = _play(
        [tool_calls(("c1", "calc", '{"expression": "123 * 456"}')), answer("So it is 56,088.")]
    )
    assert report == {"final": "So it is 56,088.", "turns": 2, "tool_calls": 1, "truncated": False}
    (path, auth, first), (_, _, second) = requests
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert first["model"] == "tiny-qwen" and first["tools"] == CalcEnv.tools and first["messages"] == START
    assistant, tool = second["messages"][2:]
    assert assistant["tool_calls"][0]["function"]["arguments"] == '{"expression": "123 * 456"}'
    assert assistant["content"] is None  # as returned
    assert tool == {"role": "tool", "tool_call_id": "c1", "name": "calc", "content": "56088"}


@pytest.mark.parametrize(
    "name, arguments",
    [
        ("calc", '{"expression": "123 * 456"}'),
        ("calc", '{"expression": "7 / 2"}'),
        ("calc", '{"expression": "1 / 0"}'),
        ("calc", '{"expression": "__import__(\'os\')"}'),
        ("calc", '{"expression": ""}'),
        ("calc", '{"expression": 5}'),
        ("calc", "{}"),
        ("calc", '{"expression": "1", "x": 2}'),
        ("calc", '{"x": 2}'),
        ("calc", "[1]"),
        ("calc", "{not json"),
        ("calc", '{"expression": "' + "1+" * 300 + '1"}'),
        ("python", '{"code": "print(1)"}'),
    ],
)
def test_tool_answers_are_worded_as_calc_env_words_them(name, arguments):
    env = CalcEnv()
    env.reset({"prompt": "q", "reward_model": {"ground_truth": "1"}}, 0)
    observations, _, _ = env.step(Action("", (ToolCall("c", name, arguments),)))
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}
    assert calc_agent.answer(call) == observations[0]["content"]


@pytest.mark.parametrize(
    "replies",
    [
        [tool_calls(("c1", "calc", '{"expression": "2 + 2"}')), answer("The answer is 4", finish="length")],
        [tool_calls(("c1", "calc", '{"expression": "2 + 2"}')), error(400, "context_length_exceeded")],
    ],
)
def test_a_reply_cut_at_its_budget_or_a_full_context_ends_the_episode_cut(replies):
    report, requests = _play(replies)
    assert report["truncated"] and report["final"] is None and report["tool_calls"] == 1
    assert len(requests) == 2


def test_a_429_is_waited_out():
    report, requests = _play([error(429, "rate_limit"), answer("4")])
    assert report == {"final": "4", "turns": 1, "tool_calls": 0, "truncated": False}
    assert len(requests) == 2


def test_at_most_max_turns_requests():
    endless = [tool_calls((f"c{i}", "calc", '{"expression": "1 + 1"}')) for i in range(10)]
    report, requests = _play(endless, max_turns=3)
    assert report == {"final": None, "turns": 3, "tool_calls": 3, "truncated": False}
    assert len(requests) == 3


def test_an_http_error_is_exit_status_3_with_the_error_on_stderr(monkeypatch, capsys):
    with FakeOpenAI([error(401, "invalid_api_key", "no such key")]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
        monkeypatch.setenv("OPENAI_MODEL", "m")
        spec = {"messages": START, "tools": CalcEnv.tools, "max_turns": 4}
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(spec)))
        assert calc_agent.main() == 3
    out, err = capsys.readouterr()
    assert out == "" and "HTTP 401" in err and "no such key" in err


def test_a_report_line_on_success(monkeypatch, capsys):
    with FakeOpenAI([answer("56088")]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.url)
        spec = {"messages": START, "tools": [], "max_turns": 2}
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(spec)))
        assert calc_agent.main() == 0
        assert "tools" not in fake.requests[0][2]  # none offered: none sent
    assert json.loads(capsys.readouterr().out) == {
        "final": "56088",
        "turns": 1,
        "tool_calls": 0,
        "truncated": False,
    }
