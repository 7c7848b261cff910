"""Histories that agent frameworks rewrite (``gateway/history.py``, ``sessions.py``): when an agent
re-sends the model's earlier turns in another form that means the same, the request still
extends the answer's exact tokens in the same segment; what changes the meaning still breaks,
counted by reason. Requests are read from the JSON the frameworks send
(``openai_api.parse_chat_request``), so the whole path from body to match is checked."""

from __future__ import annotations

import json

import pytest
from relayrl.common.v1 import common_pb2 as c
from relayrl.gateway.openai_api import parse_chat_request

from tests.unit.test_gateway_sessions import STOP, sample, session

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}  # fmt: skip
STRICT = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "strict": True,
    "parameters": {"title": "calc_args", "type": "object", "additionalProperties": False,
                   "properties": {"expression": {"type": "string", "title": "Expression"}},
                   "required": ["expression"]}}}  # fmt: skip
SYSTEM = {"role": "system", "content": "Use calc."}
USER = {"role": "user", "content": "What is 12 * 34?"}
ARGS = '{"expression": "12 * 34"}'


def body(*messages, tools=(CALC,)) -> dict:
    return {"model": "m", "messages": list(messages), "tools": list(tools)}


def answered(s, req_body: dict, content: str = "", args: str = ARGS):
    """Record the session's first call: the model called calc (after ``content``)."""
    req = parse_chat_request(req_body)
    turn = sample([1, 2], [10, 11, STOP], ("calc", args), text=content)
    turn.content = content
    return s.record(s.plan(req), req, turn)


def extends(s, req_body: dict) -> str:
    """Plan ``req_body``: "" when it extends the first call, else the break's reason."""
    plan = s.plan(parse_chat_request(req_body))
    return "" if plan.parent == 0 else plan.reason


def smolagents_text(content: str, args: dict) -> str:
    """How smolagents re-sends an answer with calls (``ActionStep.to_messages``, merged)."""
    calls = [{"id": "call_0_0", "type": "function", "function": {"name": "calc", "arguments": args}}]
    return (f"{content}\n" if content else "") + "Calling tools:\n" + str(calls)


@pytest.mark.parametrize("content", ["", "Let me compute."])
def test_calls_re_sent_as_text_and_results_as_user_messages_continue_the_segment(content):
    s = session()
    answered(s, body(SYSTEM, USER), content)
    again = {
        "role": "assistant",
        "content": [{"type": "text", "text": smolagents_text(content, json.loads(ARGS))}],
    }
    observation = {"role": "user", "content": [{"type": "text", "text": "Observation:\n408"}]}
    assert extends(s, body(SYSTEM, USER, again, observation)) == ""


def test_arguments_re_serialized_ids_renamed_and_text_stripped_continue_the_segment():
    s = session()
    answered(s, body(SYSTEM, USER), "Let me compute.")
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "calc", "arguments": '{"expression":"12 * 34"}'},
    }
    again = {"role": "assistant", "content": "  Let me compute.\n", "tool_calls": [call]}
    assert (
        extends(s, body(SYSTEM, USER, again, {"role": "tool", "tool_call_id": "call_abc", "content": "408"}))
        == ""
    )


def test_tool_schemas_with_strict_titles_and_additional_properties_are_the_same_tools():
    s = session()
    answered(s, body(SYSTEM, USER, tools=[STRICT]))
    call = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": ARGS}}
    nxt = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "tool_call_id": "c", "content": "408"}]  # fmt: skip
    assert extends(s, body(*nxt, tools=[CALC])) == ""
    reordered = {"function": {**CALC["function"]}, "type": "function"}  # key order is spelling
    assert extends(s, body(*nxt, tools=[reordered])) == ""
    other = {"type": "function", "function": {**CALC["function"], "description": "Multiply."}}
    assert extends(s, body(*nxt, tools=[other])) == "tools_changed"  # what the model reads changed
    # And the model is shown the schema without them, whichever form the framework sent.
    assert parse_chat_request(body(USER, tools=[STRICT])).tools_json == json.dumps([CALC])


@pytest.mark.parametrize(
    "again",
    [
        {"role": "assistant", "content": smolagents_text("", {"expression": "12 * 35"})},  # other arguments
        {
            "role": "assistant",
            "content": "Calling tools:\n[{'function': {'name': 'calc', 'arguments': __import__('os')}}]",
        },
        {"role": "assistant", "content": "I computed it."},  # the answer replaced by a summary
    ],
    ids=["other_arguments", "code_not_literals", "summary"],
)
def test_what_changes_the_meaning_still_breaks_counted(again):
    s = session()
    answered(s, body(SYSTEM, USER))
    assert (
        extends(s, body(SYSTEM, USER, again, {"role": "user", "content": "Observation:\n408"}))
        == "history_rewritten"
    )


def test_a_user_message_after_a_text_answer_continues_the_segment():
    """An agent that took the model's text as its answer and asks again (every framework, after
    a malformed call reached it as text)."""
    s = session()
    req = parse_chat_request(body(SYSTEM, USER))
    text = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 * 34"\n</tool_call>'
    bad = sample([1, 2], [10, STOP], ("", text), text=text)
    bad.tool_calls[0].parse = c.TOOL_CALL_PARSE_INVALID_JSON
    reply = s.record(s.plan(req), req, bad).message
    assert reply.content == text and not reply.tool_calls
    again = {"role": "assistant", "content": text.strip()}
    assert extends(s, body(SYSTEM, USER, again, {"role": "user", "content": "Use the tool."})) == ""
