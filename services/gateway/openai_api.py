"""The JSON of the gateway's HTTP API, without HTTP: OpenAI ``chat.completions`` bodies read into a
``ChatRequest``, an ``Answer`` written back as a completion or as stream chunks, errors in OpenAI's
shape, and the body of ``POST /rl/set_reward``. ``http.py`` moves these dicts over the wire.

What is read and what is dropped: messages, tools, the token limit and the stream flags are read
and checked; sampling fields (temperature, top_p, seed, stop, penalties, logit_bias, logprobs,
response_format, ...) are accepted and ignored, because the experiment sets sampling for every
turn (an agent cannot change the policy's distribution). Unknown top-level fields are ignored,
since OpenAI clients send extras. Every refusal is a ``BadRequest`` whose ``param`` names the
field (``messages[2].tool_calls[0].function.arguments``) and whose message never echoes the
agent's value, so it stays short.
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
_TOOL_CHOICES = (None, "auto", "none")


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
    args = _str(fn.get("arguments"), f"{param}.function.arguments", limit=MAX_TEXT_CHARS)
    failed = call.get("relayrl_parse_error")
    if failed is not None:  # a call the gateway gave as it could not parse it, echoed back
        status = {v: k for k, v in PARSE_ERRORS.items()}.get(failed)
        if status is None:
            raise BadRequest(f"{param}.relayrl_parse_error is not one the gateway gives", param=param)
        return common_pb2.ToolCall(
            id=_str(call.get("id"), f"{param}.id", limit=MAX_ID_CHARS, empty=False),
            name=_str(fn.get("name"), f"{param}.function.name", limit=MAX_NAME_CHARS),
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
        raise BadRequest(
            f"{param}.function.arguments must be a JSON object text", param=f"{param}.function.arguments"
        )
    if _SURROGATE_ESCAPE.search(args) and _holds_surrogate(value):
        raise BadRequest(
            f"{param}.function.arguments holds a lone surrogate in a string",
            param=f"{param}.function.arguments",
        )
    return common_pb2.ToolCall(
        id=_str(call.get("id"), f"{param}.id", limit=MAX_ID_CHARS, empty=False),
        name=_str(fn.get("name"), f"{param}.function.name", limit=MAX_NAME_CHARS, empty=False),
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
    """``tools`` as ``tools_json``: the array as sent (key order kept), "" for none."""
    if value is None:
        return ""
    tools = _list(value, "tools", limit=MAX_TOOLS)
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if _dict(tool, p).get("type") != "function":
            raise BadRequest(f"{p}.type must be 'function'", param=f"{p}.type")
        fn = _dict(tool.get("function"), f"{p}.function")
        _str(fn.get("name"), f"{p}.function.name", limit=MAX_NAME_CHARS, empty=False)
    return json.dumps(tools) if tools else ""


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

    Roles: "developer" is read as "system". ``n`` may only be 1; ``tool_choice`` may be "auto" or
    "none" (the tools stay in the prompt, as the chat template renders them, but no call is read
    out of the answer: it is all text). Streaming flags are read by ``include_usage``.

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
    if body.get("tool_choice") not in _TOOL_CHOICES:
        raise BadRequest("tool_choice is not supported: only 'auto' and 'none' are", param="tool_choice")
    if body.get("functions") is not None:
        raise BadRequest("functions is not supported: use tools", param="functions")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    include_usage(body)
    return ChatRequest(
        messages=messages,
        tools_json=_tools(body.get("tools")),
        max_tokens=_max_tokens(body),
        model=model,
        stream=bool(stream),
        tool_choice=body.get("tool_choice") or "auto",
        prefix_keys=history.prefix_keys(messages),
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
