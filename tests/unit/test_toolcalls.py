"""Tool-call parsers (``relayrl.generator.toolcalls``): well-formed and malformed completions in
both formats, bounded work on hostile input, and the round trip template -> parser on the
Qwen2.5, Llama-3.1 and tiny templates."""

from __future__ import annotations

import json
import time

import pytest
from relayrl.generator.bridge import ChatCodec
from relayrl.generator.toolcalls import (
    MAX_CALLS,
    MAX_RAW_CHARS,
    Parse,
    openai_tool_call,
    parse_hermes,
    parse_llama3_json,
    parse_tool_calls,
)

from tests.kit.chat import chat_tokenizer


def calls_of(text: str, fmt: str = "hermes"):
    content, calls = parse_tool_calls(text, fmt)
    return content, [(c.id, c.name, c.arguments_json, c.parse) for c in calls]


def test_hermes_several_calls_and_content():
    text = (
        'I will look.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "12 * 34"}}\n</tool_call>\n'
        '<tool_call>{"name":"search","arguments":{"q":"数字 \\"x\\"","n":[1,2]}}</tool_call> done'
    )
    content, calls = calls_of(text)
    assert content == "I will look.\n\n done"
    assert calls == [
        ("call_0", "calc", '{"expr": "12 * 34"}', Parse.OK),
        ("call_1", "search", '{"q": "数字 \\"x\\"", "n": [1, 2]}', Parse.OK),
    ]


def test_hermes_without_calls_is_content_only():
    assert calls_of("  The answer is 408.\n") == ("The answer is 408.", [])
    assert calls_of('{"name": "calc"}') == ('{"name": "calc"}', [])  # no tags: not a call


@pytest.mark.parametrize(
    ("body", "status", "name"),
    [
        ('{"name": "calc", "arguments": {"a": 1}', Parse.INVALID_JSON, ""),
        ("[1, 2]", Parse.INVALID_JSON, ""),
        ("", Parse.INVALID_JSON, ""),
        ('{"arguments": {}}', Parse.MISSING_NAME, ""),
        ('{"name": 3, "arguments": {}}', Parse.MISSING_NAME, ""),
        ('{"name": "", "arguments": {}}', Parse.MISSING_NAME, ""),
        ('{"name": "' + "n" * 129 + '", "arguments": {}}', Parse.MISSING_NAME, ""),
        ('{"name": "calc", "arguments": [1]}', Parse.INVALID_ARGUMENTS, "calc"),
        ('{"name": "calc", "arguments": "not json"}', Parse.INVALID_ARGUMENTS, "calc"),
        ('{"name": "calc", "arguments": "[1]"}', Parse.INVALID_ARGUMENTS, "calc"),
    ],
)
def test_hermes_malformed_calls_keep_their_raw_text(body, status, name):
    content, calls = calls_of(f"before <tool_call>{body}</tool_call> after")
    assert content == "before  after"
    assert calls == [("call_0", name, body.strip()[:MAX_RAW_CHARS], status)]


def test_hermes_arguments_as_a_json_string_or_missing_are_accepted():
    _, calls = calls_of(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    assert calls == [("call_0", "f", '{"a": 1}', Parse.OK), ("call_1", "g", "{}", Parse.OK)]


def test_hermes_unclosed_block_and_calls_before_it():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>\n{"name": "b", "argu'
    content, calls = calls_of(text)
    assert content == "then"
    assert calls == [
        ("call_0", "a", "{}", Parse.OK),
        ("call_1", "", '{"name": "b", "argu', Parse.UNCLOSED_BLOCK),
    ]


def test_ids_take_the_prefix_and_are_unique():
    _, calls = parse_hermes("<tool_call>{}</tool_call>" * 3, id_prefix="call_2_")
    assert [c.id for c in calls] == ["call_2_0", "call_2_1", "call_2_2"]


def test_work_is_bounded_on_hostile_completions():
    many = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 1000
    t0 = time.perf_counter()
    content, calls = parse_hermes(many)
    assert len(calls) == MAX_CALLS and content.startswith("<tool_call>")  # the rest is left as text
    _, deep = parse_hermes("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert deep[0].parse == Parse.INVALID_JSON and len(deep[0].arguments_json) == MAX_RAW_CHARS
    _, opens = parse_hermes("<tool_call>" * 50_000)
    assert opens[0].parse == Parse.UNCLOSED_BLOCK and len(opens) == 1
    _, deep3 = parse_llama3_json("{" * 100_000)
    assert deep3[0].parse == Parse.INVALID_JSON
    assert time.perf_counter() - t0 < 2.0


def test_llama3_json_with_and_without_the_python_tag():
    for text in (
        '<|python_tag|>{"name": "calc", "parameters": {"expr": "1+1"}}<|eom_id|>',
        '{"name": "calc", "parameters": {"expr": "1+1"}}',
        ' {"name": "calc", "parameters": {"expr": "1+1"}}<|eot_id|>',
        '{"name": "calc", "arguments": {"expr": "1+1"}}',
    ):
        assert calls_of(text, "llama3_json") == ("", [("call_0", "calc", '{"expr": "1+1"}', Parse.OK)]), text


def test_llama3_json_plain_text_and_malformed_calls():
    assert calls_of("The answer is {42}.", "llama3_json") == ("The answer is {42}.", [])
    assert calls_of("408<|eot_id|>", "llama3_json") == ("408", [])
    assert calls_of('{"name": "calc", "parameters": ', "llama3_json")[1][0][3] == Parse.INVALID_JSON
    assert calls_of('<|python_tag|>calc.call(x="1")', "llama3_json")[1][0][3] == Parse.INVALID_JSON
    assert calls_of('{"parameters": {}}', "llama3_json")[1][0][3] == Parse.MISSING_NAME
    assert calls_of('{"name": "f", "parameters": 3}', "llama3_json")[1][0][3] == Parse.INVALID_ARGUMENTS


def test_empty_format_reads_no_calls_and_unknown_formats_are_refused():
    assert parse_tool_calls(" <tool_call>{}</tool_call> ", "") == ("<tool_call>{}</tool_call>", [])
    with pytest.raises(ValueError, match="unknown tool format"):
        parse_tool_calls("x", "xml")


@pytest.mark.parametrize(
    ("family", "fmt"), [("qwen2_5", "hermes"), ("tiny", "hermes"), ("llama3_1", "llama3_json")]
)
def test_round_trip_template_renders_what_the_parser_reads(family, fmt):
    codec = ChatCodec(chat_tokenizer(family))
    head = [{"role": "user", "content": "Go."}]
    args = {"expr": 'say "hi"\n', "n": -3, "x": 0.25, "ok": False, "l": [1, {"k": None}], "u": "数字 ✓"}
    n_calls = 1 if family == "llama3_1" else 3
    msg = {"role": "assistant", "content": "Calling.",
           "tool_calls": [openai_tool_call(f"c{i}", f"tool_{i}", args) for i in range(n_calls)]}  # fmt: skip
    opened = codec.render(head)
    closed = codec.render([*head, msg], add_generation_prompt=False)
    completion = closed[len(opened) :]
    completion = completion[: completion.index(next(iter(codec.end_of_turn_ids))) + 1]
    content, calls = parse_tool_calls(codec.completion_text(completion), fmt)
    assert [(c.name, json.loads(c.arguments_json), c.parse) for c in calls] == [
        (f"tool_{i}", args, Parse.OK) for i in range(n_calls)
    ]
    assert content == ("" if family == "llama3_1" else "Calling.")  # Llama-3.1 drops a call's text
