"""The gateway's Responses API (``POST /v1/responses``: ``gateway/responses_api.py``) over a real
aiohttp server on 127.0.0.1 port 0: in front of a fake ``Sessions`` (``test_gateway_http``) for
what the official ``openai`` client reads and what a request turns into, and in front of a real
generator servicer on a scripted model (``tests/kit/agent_stack.py``) for ``previous_response_id``
and the recording.

What is checked: the client reads answers plain and streamed (the stream's events add up to the
plain response, and the SDK's accumulator agrees), tool calls as ``function_call`` items whose
echo, with ``function_call_output`` items, arrives as the chat request the sessions know; a
turn cut at its budget is "incomplete"; every field the request may not have is refused with a
400 whose ``param`` names it (the server goes on serving: ``serving`` checks on its way out);
``previous_response_id`` continues the named answer in the same segment, and an unknown one is
``previous_response_not_found``; ``tool_choice`` "required" and named functions reach the
generator as constraints, from both APIs, and are refused where they cannot be enforced.
"""

from __future__ import annotations

import json

import pytest
from relayrl.common.v1 import common_pb2 as c
from relayrl.gateway.api import Answer

from tests.kit.agent_stack import QUESTION, stack
from tests.unit.test_gateway_http import (
    MODEL,
    PLAIN,
    TOOL_SPECS,
    TOOLS,
    TOOLS_ONLY,
    auth,
    error_of,
    openai_client,
    serving,
)

openai = pytest.importorskip("openai")
RESPONSES = "/v1/responses"
TOOL = {"type": "function", "name": "calc", "description": "Evaluate arithmetic.", "strict": True,
        "parameters": {"type": "object", "title": "calc_args", "additionalProperties": False,
                       "properties": {"expression": {"type": "string", "title": "Expression"}}}}  # fmt: skip
CUT = Answer(c.ChatMessage(role="assistant", content="12 * 34 is"), "length", 9, 4, "resp_cut", 1700000003)


@pytest.fixture
async def gw():
    async with serving() as s:
        yield s


def _as_response(answer: Answer) -> Answer:
    return Answer(answer.message, answer.finish_reason, answer.prompt_tokens, answer.completion_tokens,
                  answer.id.replace("chatcmpl-", "resp_"), answer.created)  # fmt: skip


async def test_the_client_reads_a_plain_answer_and_the_request_arrives_as_a_chat_request(gw):
    gw.sessions.answer = _as_response(PLAIN)
    async with openai_client(gw.port) as client:
        r = await client.responses.create(
            model=MODEL, instructions="Be brief.", input="What is 2 + 2?", tools=[TOOL],
            temperature=0.2, max_output_tokens=32, store=False, metadata={"task": "t1"},
            reasoning={"effort": "low"}, include=["message.output_text.logprobs"],
        )  # fmt: skip
    assert (r.id, r.object, r.status, r.model) == ("resp_plain", "response", "completed", MODEL)
    assert r.output_text == "2 + 2 = 4." and r.output[0].type == "message"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (12, 6, 18)
    assert r.metadata == {"task": "t1"} and r.max_output_tokens == 32
    (req,) = gw.sessions.requests
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be brief."),
        ("user", "What is 2 + 2?"),
    ]
    assert req.api == "responses" and req.instructions and req.max_tokens == 32
    # The tool as the model is shown it: no strict flag, no titles, no additionalProperties.
    assert json.loads(req.tools_json) == [{"type": "function", "function": {
        "name": "calc", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


async def test_tool_calls_are_function_call_items_and_their_echo_is_the_chat_dialogue(gw):
    gw.sessions.answer = _as_response(TOOLS)
    async with openai_client(gw.port) as client:
        r = await client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL])
        kinds = [item.type for item in r.output]
        assert kinds == ["message", "function_call", "function_call"]
        calls = [item for item in r.output if item.type == "function_call"]
        assert [(x.call_id, x.name) for x in calls] == [("call_0_0", "calc"), ("call_0_1", "lookup")]
        assert json.loads(calls[0].arguments) == {"expression": "2+2"}
        # The agent's next turn: what it got, its tools' outputs, as the Agents SDK sends them.
        echoed = [item.model_dump(exclude_none=True) for item in r.output]
        outputs = [{"type": "function_call_output", "call_id": x.call_id, "output": "4"} for x in calls]
        gw.sessions.answer = _as_response(PLAIN)
        await client.responses.create(
            model=MODEL, input=[{"role": "user", "content": QUESTION}, *echoed, *outputs], tools=[TOOL]
        )
    user, assistant, tool0, tool1 = gw.sessions.requests[1].messages
    assert assistant.content == "Let me compute." and list(assistant.tool_calls) == list(
        TOOLS.message.tool_calls
    )
    assert (tool0.role, tool0.tool_call_id, tool0.content, tool1.tool_call_id) == (
        "tool",
        "call_0_0",
        "4",
        "call_0_1",
    )


@pytest.mark.parametrize(
    "answer", [PLAIN, TOOLS, TOOLS_ONLY, CUT], ids=["plain", "tools", "tools_only", "cut"]
)
async def test_the_stream_adds_up_to_the_plain_response(gw, answer):
    gw.sessions.answer = _as_response(answer)
    kwargs = {"model": MODEL, "input": QUESTION, "tools": [TOOL]}
    async with openai_client(gw.port) as client:
        plain = await client.responses.create(**kwargs)
        events = [e async for e in await client.responses.create(**kwargs, stream=True)]
        final = plain
        if answer is not CUT:  # the SDK's helper knows no end but "response.completed"
            async with client.responses.stream(**kwargs) as helper:
                final = await helper.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert text == plain.output_text
    assert args == [x.arguments for x in plain.output if x.type == "function_call"]
    assert _items(events[-1].response) == _items(plain) == _items(final)
    assert final.status == plain.status == ("incomplete" if answer is CUT else "completed")
    if answer is CUT:
        assert plain.incomplete_details.reason == "max_output_tokens"


def _items(r) -> list[dict]:
    """A response's output items without their ids (fresh per answer) and the SDK's parsing."""
    out = []
    for item in r.output:
        d = {k: v for k, v in item.model_dump().items() if k not in ("id", "parsed_arguments")}
        if "content" in d:
            d["content"] = [{k: v for k, v in part.items() if k != "parsed"} for part in d["content"]]
        out.append(d)
    return out


def _body(**fields) -> dict:
    return {"model": MODEL, "input": QUESTION, "tools": [TOOL], **fields}


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (_body(tools=[{"type": "web_search"}]), 400, "invalid_request", "tools[0].type"),
        (_body(tools=[{"type": "function"}]), 400, "invalid_request", "tools[0].name"),
        (_body(input=[{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]), 400,
         "invalid_request", "input[1].type"),
        (_body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
         "invalid_request", "input[0].content[0].type"),
        (_body(input=[{"type": "function_call", "call_id": "c", "name": "calc", "arguments": "[1"}]), 400,
         "invalid_request", "input[0].arguments"),
        (_body(input=[{"type": "function_call", "name": "calc", "arguments": "{}"}]), 400,
         "invalid_request", "input[0].call_id"),
        (_body(input=[{"type": "function_call_output", "call_id": "c"}]), 400, "invalid_request", "input[0].output"),
        (_body(input=[{"role": "tool", "content": "4"}]), 400, "invalid_request", "input[0].role"),
        (_body(input=None), 400, "invalid_request", "input"),
        (_body(input=[]), 400, "invalid_request", "input"),
        (_body(tool_choice={"type": "function", "name": "search"}), 400, "invalid_request", "tool_choice.name"),
        (_body(tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}), 400, "invalid_request",
         "tool_choice.type"),
        (_body(tools=None, tool_choice="required"), 400, "invalid_request", "tool_choice"),
        (_body(parallel_tool_calls="no"), 400, "invalid_request", "parallel_tool_calls"),
        (_body(text={"format": {"type": "xml"}}), 400, "invalid_request", "text.format.type"),
        (_body(text={"format": {"type": "json_schema", "name": "x", "schema": [1]}}), 400, "invalid_request",
         "text.format.schema"),
        (_body(conversation="conv_1"), 400, "invalid_request", "conversation"),
        (_body(prompt={"id": "pmpt_1"}), 400, "invalid_request", "prompt"),
        (_body(background=True), 400, "invalid_request", "background"),
        (_body(max_output_tokens=0), 400, "invalid_request", "max_output_tokens"),
        (_body(stream="yes"), 400, "invalid_request", "stream"),
        (_body(instructions=["x"]), 400, "invalid_request", "instructions"),
        (_body(relayrl_malformed_calls="sometimes"), 400, "invalid_request", "relayrl_malformed_calls"),
        (_body(model="gpt-5"), 404, "model_not_found", "model"),
    ],
    ids=["hosted_tool", "tool_no_name", "reasoning_item", "image_part", "call_bad_arguments", "call_no_call_id",
         "output_missing", "tool_role_message", "input_missing", "input_empty", "named_unknown_tool",
         "allowed_tools", "required_without_tools", "parallel_not_bool", "xml_format", "schema_not_object", "conversation",
         "stored_prompt", "background", "max_output_tokens_0", "stream_not_bool", "instructions_not_text",
         "malformed_calls_option", "unknown_model"],
)  # fmt: skip
async def test_bad_responses_requests_get_openai_errors_naming_the_field(gw, body, status, code, param):
    async with gw.http.post(RESPONSES, json=body, headers=auth()) as r:
        assert r.status == status
        err = await error_of(r)
    assert (err["code"], err["param"]) == (code, param), err["message"]
    assert gw.sessions.requests == []


async def test_responses_are_behind_the_same_keys_and_bounds(gw):
    async with gw.http.post(RESPONSES, json=_body(), headers=auth("rrl-nobody")) as r:
        assert r.status == 401 and (await error_of(r))["code"] == "invalid_api_key"
    async with gw.http.post(RESPONSES, data=b'{"model": ', headers=auth()) as r:
        assert r.status == 400
    async with gw.http.get(RESPONSES, headers=auth()) as r:
        assert r.status == 405 and (await error_of(r))["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("tool_choice", "param"),
    [
        ({"type": "function", "function": {"name": "search"}}, "tool_choice.function.name"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice.type"),
        ({"type": "function"}, "tool_choice.function"),
        ("sometimes", "tool_choice"),
    ],
)
async def test_chat_tool_choices_that_name_no_tool_are_refused_naming_the_field(gw, tool_choice, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOL_SPECS,
            "tool_choice": tool_choice}  # fmt: skip
    async with gw.http.post("/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 400 and (await error_of(r))["param"] == param


# -- through a gateway replica and a generator ---------------------------------------------------


async def test_previous_response_id_continues_the_answer_in_the_same_segment():
    async with stack() as st:
        opened = await st.open()
        async with openai_client(st.port) as client:
            client.api_key = opened.session_key
            first = await client.responses.create(
                model=MODEL, instructions="Use calc.", input=QUESTION, tools=[TOOL]
            )
            (call,) = [x for x in first.output if x.type == "function_call"]
            out = {"type": "function_call_output", "call_id": call.call_id, "output": "408"}
            second = await client.responses.create(
                model=MODEL,
                instructions="Use calc.",
                previous_response_id=first.id,
                input=[out],
                tools=[TOOL],
            )
            assert "408" in second.output_text
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model=MODEL, previous_response_id="resp_nope", input="hi")
        assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
        closed = await st.close(opened.session_key)
    assert closed.calls == 2 and closed.history_breaks == 0 and len(closed.segments) == 1


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", ["required", "calc"])
async def test_required_and_named_tool_choices_reach_the_generator_as_constraints(api, choice):
    async with stack() as st:
        opened = await st.open()
        async with openai_client(st.port) as client:
            client.api_key = opened.session_key
            if api == "chat":
                tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
                r = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOL_SPECS,
                    tool_choice=tc, parallel_tool_calls=False,
                )  # fmt: skip
                assert r.choices[0].message.tool_calls[0].function.name == "calc"
            else:
                tc = choice if choice == "required" else {"type": "function", "name": choice}
                r = await client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL], tool_choice=tc)
                assert [x.name for x in r.output if x.type == "function_call"] == ["calc"]
        closed = await st.close(opened.session_key)
    (_, (prompt,), spec) = st.engine.calls[0]
    assert spec.tool_choice == ("required" if choice == "required" else "function")
    assert prompt.constraint and closed.constrained_calls == 1  # checked against the policy's call


async def test_a_tool_choice_a_session_cannot_enforce_is_refused():
    async with stack() as st:
        opened = await st.open(tool_format="")  # this session reads no tool calls
        async with openai_client(st.port) as client:
            client.api_key = opened.session_key
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=TOOL_SPECS,
                    tool_choice="required",
                )  # fmt: skip
            assert e.value.param == "tool_choice" and "cannot be enforced" in e.value.message
            # and the session goes on
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
            assert r.choices[0].finish_reason == "stop"
        await st.close(opened.session_key)
