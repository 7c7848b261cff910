"""The JSON of the gateway's HTTP API, without HTTP: OpenAI ``chat.completions`` bodies read into a
``ChatRequest``, an ``Answer`` written back as a completion or as stream chunks, errors in OpenAI's
shape, and the body of ``POST /rl/set_reward``. ``http.py`` moves these dicts over the wire.

What is read and what is dropped: messages, tools, ``tool_choice`` (every kind OpenAI has for
functions: "auto", "none", "required" and a named function, the last two enforced while the
model samples), ``parallel_tool_calls``, the token limit and the stream flags are read and
checked, and so is ``response_format`` (json_schema and json_object answers are enforced while the
model samples); sampling fields (temperature, top_p, seed, stop, penalties, logit_bias,
logprobs, ...) are accepted and ignored, because the experiment sets sampling for every turn (an
agent cannot change the policy's distribution). Unknown top-level fields are ignored,
since OpenAI clients send extras. Tool schemas are shown to the model without what frameworks
add for OpenAI's strict mode (``history.plain_tool``). Every refusal is a ``BadRequest`` whose
``param`` names the field (``messages[2].tool_calls[0].function.arguments``) and whose message
never echoes the agent's value, so it stays short. The Responses API's bodies are read into the
same ``ChatRequest`` by ``responses_api.py``, with these helpers.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from relayrl.common.v1 import common_pb2
from relayrl.gateway import history
from relayrl.gateway.api import Answer, BadRequest, ChatRequest, GatewayError, RewardSet

MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
"""Per assistant message: ``ChatMessage.tool_calls`` holds at most 64 (common.proto)."""
MAX_TEXT_CHARS = 4_000_000
"""A message's content or a call's arguments; the body as a whole is bounded by the server."""
MAX_MODEL_CHARS = 256
MAX_ID_CHARS = 64
"""A tool call's id (``ToolCall.id`` in common.proto)."""
MAX_NAME_CHARS = 128
"""A tool's name (``ToolCall.name`` in common.proto)."""
MAX_TOKENS = 1 << 24
MAX_REWARD_COMPONENTS = 32
MAX_COMPONENT_CHARS = 64

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
r"""A ``\uD800``-``\uDFFF`` escape: the only way a strictly decoded text yields a surrogate."""
_SURROGATE = re.compile("[\ud800-\udfff]")

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MALFORMED_CALLS = {"text": False, "calls": True}
"""``relayrl_malformed_calls``: how a tool call the model wrote malformed reaches the agent. "text"
(the default): the answer is the model's text, finish reason "stop", which every client takes.
"calls": as a call with ``relayrl_parse_error`` (for an agent that answers it as the white-box env
does, ``services/env/agents/calc_agent.py``)."""


def decode_json(raw: bytes) -> object:
    r"""A request body as JSON: UTF-8 (a leading byte-order mark is let through), strict JSON
    (no NaN or Infinity), no lone surrogate in any string or key (JSON lets ``"\ud800"``
    through; no UTF-8 text, protobuf string or tokenizer takes it). Anything else is a
    ``BadRequest``, before any of it reaches a session.

    >>> decode_json(b'{"a": ["\\u00e9", "\\ud83d\\ude00"]}')
    {'a': ['é', '😀']}
    >>> for bad in (b'{"a": "\xff"}', b'{"a": "\xed\xa0\x80"}', b'{"a": "\\ud800"}', b'{"a": NaN}'):
    ...     try:
    ...         decode_json(bad)
    ...     except BadRequest as e:
    ...         print(e)
    request body is not UTF-8 text
    request body is not UTF-8 text
    request body holds a lone surrogate (an unpaired \ud800-\udfff escape) in a string
    request body is not valid JSON
    """
    try:
        text = raw.decode("utf-8-sig")  # strict: also refuses UTF-8-encoded surrogates
    except UnicodeDecodeError:
        raise BadRequest("request body is not UTF-8 text") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: deeply nested arrays
        raise BadRequest("request body is not valid JSON") from None
    if _SURROGATE_ESCAPE.search(text) and _holds_surrogate(value):
        raise BadRequest(
            r"request body holds a lone surrogate (an unpaired \ud800-\udfff escape) in a string"
        )
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python's extension, not JSON


def _holds_surrogate(value: object) -> bool:
    """Whether a string or key anywhere in ``value`` holds a surrogate (JSON joins the escapes
    of a pair into one character: what is left is a lone one)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _str(value: object, param: str, *, limit: int, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{param} must be a string", param=param)
    if len(value) > limit:
        raise BadRequest(f"{param} is longer than {limit} characters", param=param)
    if not empty and not value:
        raise BadRequest(f"{param} must not be empty", param=param)
    return value


def _dict(value: object, param: str) -> dict:
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    return value


def _list(value: object, param: str, *, limit: int) -> list:
    if not isinstance(value, list):
        raise BadRequest(f"{param} must be an array", param=param)
    if len(value) > limit:
        raise BadRequest(f"{param} has more than {limit} items", param=param)
    return value


def _number(value: object, param: str) -> float:
    # bool is an int in Python, never a number in JSON; NaN and inf are not JSON numbers either.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{param} must be a finite number", param=param)
    return float(value)


def _content(value: object, param: str) -> str:
    """A message's text: a string, or text parts joined by newlines (as vLLM joins them, so the
    prompt renders as a vLLM-served model would see it)."""
    if value is None or isinstance(value, str):
        return _str(value or "", param, limit=MAX_TEXT_CHARS)
    texts = []
    for i, part in enumerate(_list(value, param, limit=MAX_MESSAGES)):
        p = f"{param}[{i}]"
        if _dict(part, p).get("type") != "text":
            raise BadRequest(f"{p}: only text content parts are supported", param=p)
        texts.append(_str(part.get("text"), f"{p}.text", limit=MAX_TEXT_CHARS))
    return _str("\n".join(texts), param, limit=MAX_TEXT_CHARS)


def _tool_call(value: object, param: str) -> common_pb2.ToolCall:
    call = _dict(value, param)
    if call.get("type", "function") != "function":
        raise BadRequest(f"{param}.type must be 'function'", param=f"{param}.type")
    fn = _dict(call.get("function"), f"{param}.function")
    fields = (f"{param}.id", f"{param}.function.name", f"{param}.function.arguments")
    return read_call(
        call.get("id"), fn.get("name"), fn.get("arguments"), call.get("relayrl_parse_error"), param, fields
    )


def read_call(
    cid: object, name: object, args: object, failed: object, param: str, fields: tuple[str, str, str]
) -> common_pb2.ToolCall:
    """One call of an assistant turn the agent sends back, checked; ``fields`` name its id, name
    and arguments in errors (a chat message's ``tool_calls[i]`` and a Responses
    ``function_call`` item spell them apart). ``failed``: its ``relayrl_parse_error``, when it is
    a call the gateway gave as the model wrote it malformed."""
    id_param, name_param, args_param = fields
    args = _str(args, args_param, limit=MAX_TEXT_CHARS)
    if failed is not None:  # a call the gateway gave as it could not parse it, echoed back
        status = {v: k for k, v in PARSE_ERRORS.items()}.get(failed)
        if status is None:
            raise BadRequest(f"{param}.relayrl_parse_error is not one the gateway gives", param=param)
        return common_pb2.ToolCall(
            id=_str(cid, id_param, limit=MAX_ID_CHARS, empty=False),
            name=_str(name, name_param, limit=MAX_NAME_CHARS),
            arguments_json=args,
            parse=status,
        )
    try:
        value = json.loads(args)  # NaN let through: the generator's parser takes it from the model
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        # The chat template renders arguments as an object (a call that did not parse comes back
        # with its relayrl_parse_error, above).
        raise BadRequest(f"{args_param} must be a JSON object text", param=args_param)
    if _SURROGATE_ESCAPE.search(args) and _holds_surrogate(value):
        raise BadRequest(f"{args_param} holds a lone surrogate in a string", param=args_param)
    return common_pb2.ToolCall(
        id=_str(cid, id_param, limit=MAX_ID_CHARS, empty=False),
        name=_str(name, name_param, limit=MAX_NAME_CHARS, empty=False),
        arguments_json=args,
        parse=common_pb2.TOOL_CALL_PARSE_OK,
    )


def _message(value: object, param: str) -> common_pb2.ChatMessage:
    msg = _dict(value, param)
    role = msg.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise BadRequest(
            f"{param}.role must be one of system, developer, user, assistant, tool", param=f"{param}.role"
        )
    out = common_pb2.ChatMessage(role=role)
    if role != "assistant" and msg.get("content") is None:
        raise BadRequest(f"{param}.content is required for role {role}", param=f"{param}.content")
    out.content = _content(msg.get("content"), f"{param}.content")
    if role == "assistant":
        if msg.get("function_call") is not None:
            raise BadRequest(
                f"{param}.function_call is not supported: use tool_calls", param=f"{param}.function_call"
            )
        calls = msg.get("tool_calls")
        if calls is not None:
            p = f"{param}.tool_calls"
            out.tool_calls.extend(
                _tool_call(c, f"{p}[{i}]") for i, c in enumerate(_list(calls, p, limit=MAX_TOOL_CALLS))
            )
    elif role == "tool":
        out.tool_call_id = _str(msg.get("tool_call_id"), f"{param}.tool_call_id", limit=MAX_ID_CHARS)
        if msg.get("name") is not None:
            out.name = _str(msg["name"], f"{param}.name", limit=MAX_NAME_CHARS)
    return out


def _tools(value: object) -> str:
    """``tools`` as ``tools_json``: the array as sent (key order kept), each tool as the model is
    shown it (``history.plain_tool``: no ``strict``, no schema ``title`` or boolean
    ``additionalProperties``), "" for none."""
    if value is None:
        return ""
    tools = _list(value, "tools", limit=MAX_TOOLS)
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if _dict(tool, p).get("type") != "function":
            raise BadRequest(f"{p}.type must be 'function'", param=f"{p}.type")
        fn = _dict(tool.get("function"), f"{p}.function")
        _str(fn.get("name"), f"{p}.function.name", limit=MAX_NAME_CHARS, empty=False)
    return tools_json(tools)


def tools_json(tools: list[dict]) -> str:
    """Checked chat-format tools as ``ChatRequest.tools_json`` ("" for none)."""
    return json.dumps([history.plain_tool(t) for t in tools]) if tools else ""


def tool_names(tools_json_text: str) -> list[str]:
    return [t["function"]["name"] for t in json.loads(tools_json_text)] if tools_json_text else []


def check_tool_choice(choice: str, name: str, names: list[str], param: str) -> None:
    """A tool choice that needs tools has some, and a named one is among them."""
    if choice in ("required", "function") and not names:
        raise BadRequest(f"{param} {choice!r} needs tools: the request has none", param=param)
    if choice == "function" and name not in names:
        raise BadRequest(f"{param}: the request's tools have no function of this name", param=param)


def _chat_tool_choice(value: object, names: list[str]) -> tuple[str, str]:
    """``(choice, function name)`` of a chat request's ``tool_choice``.

    >>> _chat_tool_choice({"type": "function", "function": {"name": "calc"}}, ["calc"])
    ('function', 'calc')
    >>> _chat_tool_choice({"type": "allowed_tools"}, ["calc"])
    Traceback (most recent call last):
    ...
    relayrl.gateway.api.BadRequest: tool_choice.type must be 'function' (or tool_choice 'auto', 'none', 'required')
    """
    if value is None or value in ("auto", "none", "required"):
        choice, name = value or "auto", ""
    elif isinstance(value, dict):
        if value.get("type") != "function":
            raise BadRequest(
                "tool_choice.type must be 'function' (or tool_choice 'auto', 'none', 'required')",
                param="tool_choice.type",
            )
        fn = _dict(value.get("function"), "tool_choice.function")
        choice = "function"
        name = _str(fn.get("name"), "tool_choice.function.name", limit=MAX_NAME_CHARS, empty=False)
    else:
        raise BadRequest(
            "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", ...}",
            param="tool_choice",
        )
    param = "tool_choice.function.name" if choice == "function" else "tool_choice"
    check_tool_choice(choice, name, names, param)
    return choice, name


def parallel_tool_calls(body: dict) -> bool:
    v = body.get("parallel_tool_calls")
    if v is not None and not isinstance(v, bool):
        raise BadRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return v is not False


MAX_SCHEMA_CHARS = 64 * 1024
"""Longest answer schema (``generator.v1.SamplingParams.json_schema``)."""


def answer_schema(fmt: object, param: str, schema_at: str) -> str:
    """The JSON schema (text) an answer format asks for, "" for free text: ``{"type": "text"}``,
    ``{"type": "json_object"}`` (any object) or ``{"type": "json_schema", ...}`` with the schema
    under ``schema_at`` (chat completions nest it in ``json_schema``, the Responses API does not).

    >>> answer_schema({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
    ...               "response_format", "json_schema.schema")
    '{"type": "object"}'
    """
    if fmt is None:
        return ""
    kind = _dict(fmt, param).get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind != "json_schema":
        raise BadRequest(
            f"{param}.type must be 'text', 'json_object' or 'json_schema'", param=f"{param}.type"
        )
    holder: object = fmt
    path = param
    for step in schema_at.split(".")[:-1]:
        path = f"{path}.{step}"
        holder = _dict(holder.get(step), path)  # type: ignore[union-attr]
    schema = holder.get(schema_at.rsplit(".", 1)[-1])  # type: ignore[union-attr]
    schema = {"type": "object"} if schema is None else _dict(schema, f"{param}.{schema_at}")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise BadRequest(
            f"{param}.{schema_at} is longer than {MAX_SCHEMA_CHARS} characters", param=f"{param}.{schema_at}"
        )
    return text


def malformed_as_calls(body: dict) -> bool:
    """``relayrl_malformed_calls`` ("text" or "calls", ``MALFORMED_CALLS``)."""
    v = body.get("relayrl_malformed_calls", "text")
    if not isinstance(v, str) or v not in MALFORMED_CALLS:
        raise BadRequest("relayrl_malformed_calls must be 'text' or 'calls'", param="relayrl_malformed_calls")
    return MALFORMED_CALLS[v]


def _max_tokens(body: dict) -> int | None:
    limits = []
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_TOKENS:
            raise BadRequest(f"{name} must be an integer from 1 to {MAX_TOKENS}", param=name)
        limits.append(v)
    # Both given (an old and a new client field): the stricter one holds.
    return min(limits) if limits else None


def parse_chat_request(body: object) -> ChatRequest:
    """A decoded ``POST /v1/chat/completions`` body, checked, as a ``ChatRequest``.

    Roles: "developer" is read as "system". ``n`` may only be 1. ``tool_choice``: "auto";
    "none" (the tools stay in the prompt, as the chat template renders them, but no call is read
    out of the answer: it is all text); "required" or a named function (enforced while the
    model samples). Streaming flags are read by ``include_usage``.

    >>> req = parse_chat_request({"model": "m", "temperature": 2, "messages": [
    ...     {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
    ...     {"role": "user", "content": "2+2?"}]})
    >>> [(m.role, m.content) for m in req.messages], req.tools_json, req.max_tokens
    ([('system', 'Be brief.'), ('user', '2+2?')], '', None)
    >>> parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2})
    Traceback (most recent call last):
    ...
    relayrl.gateway.api.BadRequest: n must be 1 (one choice per request)
    """
    body = _dict(body, "body")
    model = _str(body.get("model"), "model", limit=MAX_MODEL_CHARS, empty=False)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty array", param="messages")
    messages = [
        _message(m, f"messages[{i}]") for i, m in enumerate(_list(raw, "messages", limit=MAX_MESSAGES))
    ]
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise BadRequest("n must be 1 (one choice per request)", param="n")
    for legacy, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(legacy) is not None:
            raise BadRequest(f"{legacy} is not supported: use {instead}", param=legacy)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    include_usage(body)
    tools = _tools(body.get("tools"))
    choice, name = _chat_tool_choice(body.get("tool_choice"), tool_names(tools))
    return ChatRequest(
        messages=messages,
        tools_json=tools,
        max_tokens=_max_tokens(body),
        model=model,
        stream=bool(stream),
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel_tool_calls(body),
        json_schema=answer_schema(body.get("response_format"), "response_format", "json_schema.schema"),
        prefix_keys=history.prefix_keys(messages),
        malformed_as_calls=malformed_as_calls(body),
    )


def include_usage(body: dict) -> bool:
    """``stream_options.include_usage``: whether a stream ends with a usage chunk.

    >>> include_usage({"stream": True, "stream_options": {"include_usage": True}}), include_usage({})
    (True, False)
    """
    opts = body.get("stream_options")
    if opts is None:
        return False
    flag = _dict(opts, "stream_options").get("include_usage")
    if flag is not None and not isinstance(flag, bool):
        raise BadRequest(
            "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
        )
    return bool(flag)


def parse_reward_set(body: object) -> RewardSet:
    """A ``POST /rl/set_reward`` body: ``{"reward": number, "components": {name: number}}``.

    >>> parse_reward_set({"reward": 1, "components": {"tests_passed": 0.5}})
    RewardSet(reward=1.0, components={'tests_passed': 0.5})
    """
    body = _dict(body, "body")
    reward = _number(body.get("reward"), "reward")
    raw = body.get("components")
    raw = {} if raw is None else _dict(raw, "components")
    if len(raw) > MAX_REWARD_COMPONENTS:
        raise BadRequest(f"components has more than {MAX_REWARD_COMPONENTS} entries", param="components")
    components = {}
    for name, value in raw.items():
        # Names become metric and record keys downstream: short and non-empty.
        if not name or len(name) > MAX_COMPONENT_CHARS:
            raise BadRequest(
                f"component names must be 1 to {MAX_COMPONENT_CHARS} characters", param="components"
            )
        components[name] = _number(value, "components")
    return RewardSet(reward=reward, components=components)


PARSE_ERRORS = {
    common_pb2.TOOL_CALL_PARSE_INVALID_JSON: "invalid_json",
    common_pb2.TOOL_CALL_PARSE_UNCLOSED_BLOCK: "unclosed_block",
    common_pb2.TOOL_CALL_PARSE_MISSING_NAME: "missing_name",
    common_pb2.TOOL_CALL_PARSE_INVALID_ARGUMENTS: "invalid_arguments",
}
"""A tool call the model wrote but that did not parse goes to the agent as a call all the same
(its name as far as it was read, its raw text as the arguments), with this status under
``relayrl_parse_error`` (an extra field OpenAI clients keep): an agent that knows it answers as
the white-box env does; one that does not finds no tool of that name and says so."""


def _call_json(c: common_pb2.ToolCall) -> dict[str, Any]:
    """A tool call of an answer as OpenAI writes it.

    >>> _call_json(common_pb2.ToolCall(id="c", name="", arguments_json="{x",
    ...                                parse=common_pb2.TOOL_CALL_PARSE_UNCLOSED_BLOCK))["relayrl_parse_error"]
    'unclosed_block'
    """
    function = {"name": c.name, "arguments": c.arguments_json}
    out: dict[str, Any] = {"id": c.id, "type": "function", "function": function}
    if c.parse in PARSE_ERRORS:
        out["relayrl_parse_error"] = PARSE_ERRORS[c.parse]
    return out


def _message_json(message: common_pb2.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        if not message.content:
            out["content"] = None  # what OpenAI sends for a turn that only calls tools
        out["tool_calls"] = [_call_json(c) for c in message.tool_calls]
    return out


def _usage(answer: Answer) -> dict[str, int]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def completion_json(answer: Answer, model: str) -> dict[str, Any]:
    """The ``chat.completion`` object of an answer.

    >>> a = Answer(common_pb2.ChatMessage(role="assistant", content="4"), "stop", 7, 2, "chatcmpl-1", 5)
    >>> c = completion_json(a, "m")
    >>> c["choices"][0]["message"], c["choices"][0]["finish_reason"], c["usage"]["total_tokens"]
    ({'role': 'assistant', 'content': '4'}, 'stop', 9)
    """
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message_json(answer.message),
                "finish_reason": answer.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(answer),
    }


def stream_chunks(answer: Answer, model: str, include_usage: bool) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream an answer, in order (the server adds
    ``data: [DONE]``).

    The generator answers whole, so a stream is a framing of the finished answer: the role, the
    content in one delta, each tool call as OpenAI sends it (id, type and name with empty
    arguments, then its arguments under the same ``index``), the finish reason, and with
    ``include_usage`` a last chunk with empty ``choices`` and the usage. Accumulating the deltas
    gives what ``completion_json`` returns.

    >>> a = Answer(common_pb2.ChatMessage(role="assistant", content="4"), "stop", 7, 2, "chatcmpl-1", 5)
    >>> [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in stream_chunks(a, "m", False)]
    [({'role': 'assistant', 'content': ''}, None), ({'content': '4'}, None), ({}, 'stop')]
    >>> stream_chunks(a, "m", True)[-1]["choices"], stream_chunks(a, "m", True)[-1]["usage"]["total_tokens"]
    ([], 9)
    """
    # Like the completion's content: null for a turn that only calls tools.
    first = "" if answer.message.content or not answer.message.tool_calls else None
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": first}]
    if answer.message.content:
        deltas.append({"content": answer.message.content})
    for i, c in enumerate(answer.message.tool_calls):
        head = {"index": i, **_call_json(c)}
        head["function"] = {"name": c.name, "arguments": ""}
        deltas.append({"tool_calls": [head]})
        if c.arguments_json:
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments_json}}]})
    choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": answer.finish_reason})
    head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": model}
    # With include_usage OpenAI sends "usage": null on every chunk but the last.
    extra = {"usage": None} if include_usage else {}
    chunks = [{**head, "choices": [choice], **extra} for choice in choices]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(answer)})
    return chunks


def error_json(err: GatewayError) -> dict[str, Any]:
    """OpenAI's error body for a refusal.

    >>> error_json(BadRequest("n must be 1", param="n"))
    {'error': {'message': 'n must be 1', 'type': 'invalid_request_error', 'param': 'n', 'code': 'invalid_request'}}
    """
    return {"error": {"message": str(err), "type": err.kind, "param": err.param, "code": err.code}}
