"""OpenAI's Responses API (``POST /v1/responses``) without HTTP: a request body read into the same
``ChatRequest`` as a chat completion's (one recording path: the sessions see no difference), and
an ``Answer`` written back as a ``response`` object or as its stream of server-sent events.
``http.py`` moves these over the wire; the JSON helpers and their rules are ``openai_api``'s.

The request, item by item (OpenAI Agents SDK and pydantic-ai send these by default):
- ``instructions``: a system message first (``previous_response_id`` does not carry an earlier
  request's instructions over, as OpenAI's API does not).
- ``input``: a string (one user message) or items: messages (roles user, system, developer,
  assistant; content a string or text parts), ``function_call`` items (added to the assistant
  message before them, as the model's turn had them), ``function_call_output`` items (tool
  messages). Other item types (reasoning, images, files, item references) are refused, naming
  the item.
- ``tools``: function tools (``strict`` accepted: it is not shown to the model); hosted tools
  (web search, file search, computer use, MCP, ...) are refused, naming the tool.
- ``tool_choice``: "auto", "none", "required", ``{"type": "function", "name": ...}``, the last
  two enforced while the model samples; ``parallel_tool_calls``; ``max_output_tokens``.
- ``previous_response_id``: an earlier answer of the same session, whose dialogue goes first.
- ``text.format``: "text", or "json_schema" and "json_object", enforced while the model samples
  (the answer is JSON of the schema; calls of the tools stay possible, as OpenAI's formats
  constrain the answer only).
- Accepted and ignored: sampling (temperature, top_p, top_logprobs), ``reasoning``, ``include``,
  ``store``, ``metadata`` (echoed), ``truncation``, ``user``, ``safety_identifier``, caching and
  service-tier hints. Refused: ``conversation``, ``prompt``, ``background``.

The answer: a ``message`` item with one ``output_text`` part for the model's text, then a
``function_call`` item per call (``call_id`` the call's id); status "incomplete" with reason
"max_output_tokens" for a turn cut at its token budget. Streamed as OpenAI streams it:
``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its
content or arguments in one delta and their ``.done`` events, ``response.output_item.done``, and
``response.completed`` (or ``response.incomplete``), each with a ``sequence_number``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from relayrl.common.v1 import common_pb2
from relayrl.gateway import history
from relayrl.gateway.api import RESPONSES, Answer, BadRequest, ChatRequest
from relayrl.gateway.openai_api import (
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_NAME_CHARS,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    MAX_TOOLS,
    PARSE_ERRORS,
    _dict,
    _list,
    _str,
    answer_schema,
    check_tool_choice,
    malformed_as_calls,
    parallel_tool_calls,
    read_call,
    tool_names,
    tools_json,
)

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_REFUSED = {
    "conversation": "conversation is not supported: send the dialogue as input items, or name an "
    "answer of this session in previous_response_id",
    "prompt": "prompt (a stored prompt template) is not supported: send instructions and input",
    "background": "background is not supported: requests are answered while they wait",
}


def _text(value: object, param: str) -> str:
    """A message's content: a string, or text parts joined by newlines (as ``openai_api`` joins
    chat content parts); a refusal part reads as its text."""
    if isinstance(value, str):
        return _str(value, param, limit=MAX_TEXT_CHARS)
    texts = []
    for i, part in enumerate(_list(value, param, limit=MAX_MESSAGES)):
        p = f"{param}[{i}]"
        kind = _dict(part, p).get("type")
        if kind in _TEXT_PARTS:
            texts.append(_str(part.get("text"), f"{p}.text", limit=MAX_TEXT_CHARS))
        elif kind == "refusal":
            texts.append(_str(part.get("refusal"), f"{p}.refusal", limit=MAX_TEXT_CHARS))
        else:
            raise BadRequest(
                f"{p}.type: only text parts are supported (input_text, output_text)", param=f"{p}.type"
            )
    return _str("\n".join(texts), param, limit=MAX_TEXT_CHARS)


def _call(item: dict, param: str) -> common_pb2.ToolCall:
    """A ``function_call`` item as a tool call, checked as a chat message's call is."""
    fields = (f"{param}.call_id", f"{param}.name", f"{param}.arguments")
    failed = item.get("relayrl_parse_error")
    return read_call(item.get("call_id"), item.get("name"), item.get("arguments"), failed, param, fields)


def _items(value: object) -> list[common_pb2.ChatMessage]:
    """``input`` as chat messages (see the module docstring)."""
    if isinstance(value, str):
        return [common_pb2.ChatMessage(role="user", content=_str(value, "input", limit=MAX_TEXT_CHARS))]
    out: list[common_pb2.ChatMessage] = []
    for i, item in enumerate(_list(value, "input", limit=MAX_MESSAGES)):
        p = f"input[{i}]"
        kind = _dict(item, p).get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None:
                raise BadRequest(
                    f"{p}.role must be one of user, system, developer, assistant", param=f"{p}.role"
                )
            out.append(common_pb2.ChatMessage(role=role, content=_text(item.get("content"), f"{p}.content")))
        elif kind == "function_call":
            if not out or out[-1].role != "assistant":  # a turn that only calls tools
                out.append(common_pb2.ChatMessage(role="assistant"))
            if len(out[-1].tool_calls) >= 64:
                raise BadRequest(f"{p}: more than 64 calls in one assistant turn", param=p)
            out[-1].tool_calls.append(_call(item, p))
        elif kind == "function_call_output":
            if item.get("output") is None:
                raise BadRequest(f"{p}.output is required: a string or text parts", param=f"{p}.output")
            out.append(
                common_pb2.ChatMessage(
                    role="tool",
                    content=_text(item["output"], f"{p}.output"),
                    tool_call_id=_str(item.get("call_id"), f"{p}.call_id", limit=MAX_ID_CHARS, empty=False),
                )
            )
        else:
            raise BadRequest(
                f"{p}.type {str(kind)[:40]!r} is not supported: messages, function_call and "
                "function_call_output items are",
                param=f"{p}.type",
            )
    return out


def _tools(value: object) -> str:
    """Function tools in the chat form the sessions and chat templates read."""
    if value is None:
        return ""
    tools = []
    for i, tool in enumerate(_list(value, "tools", limit=MAX_TOOLS)):
        p = f"tools[{i}]"
        kind = _dict(tool, p).get("type")
        if kind != "function":
            raise BadRequest(
                f"{p}.type {str(kind)[:40]!r} is not supported: only function tools are (no hosted tools)",
                param=f"{p}.type",
            )
        fn: dict[str, Any] = {"name": _str(tool.get("name"), f"{p}.name", limit=MAX_NAME_CHARS, empty=False)}
        if tool.get("description") is not None:
            fn["description"] = _str(tool["description"], f"{p}.description", limit=MAX_TEXT_CHARS)
        if tool.get("parameters") is not None:
            fn["parameters"] = _dict(tool["parameters"], f"{p}.parameters")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise BadRequest(f"{p}.strict must be a boolean", param=f"{p}.strict")
        tools.append({"type": "function", "function": fn})
    return tools_json(tools)


def _tool_choice(value: object, names: list[str]) -> tuple[str, str]:
    """``(choice, function name)`` of a Responses ``tool_choice``.

    >>> _tool_choice({"type": "function", "name": "calc"}, ["calc"]), _tool_choice(None, [])
    (('function', 'calc'), ('auto', ''))
    """
    if value is None or value in ("auto", "none", "required"):
        choice, name = value or "auto", ""
    elif isinstance(value, dict) and value.get("type") == "function":
        choice = "function"
        name = _str(value.get("name"), "tool_choice.name", limit=MAX_NAME_CHARS, empty=False)
    elif isinstance(value, dict):
        raise BadRequest(
            f"tool_choice.type {str(value.get('type'))[:40]!r} is not supported: 'auto', 'none', "
            '\'required\' or {"type": "function", "name": ...} are',
            param="tool_choice.type",
        )
    else:
        raise BadRequest("tool_choice must be 'auto', 'none', 'required' or a function", param="tool_choice")
    check_tool_choice(choice, name, names, "tool_choice.name" if choice == "function" else "tool_choice")
    return choice, name


def _max_output_tokens(body: dict) -> int | None:
    v = body.get("max_output_tokens")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_TOKENS:
        raise BadRequest(
            f"max_output_tokens must be an integer from 1 to {MAX_TOKENS}", param="max_output_tokens"
        )
    return v


def _answer_schema(body: dict) -> str:
    """``text.format``'s schema ("" for free text)."""
    text = body.get("text")
    if text is None:
        return ""
    return answer_schema(_dict(text, "text").get("format"), "text.format", "schema")


def parse_responses_request(body: object) -> ChatRequest:
    """A decoded ``POST /v1/responses`` body, checked, as a ``ChatRequest``.

    >>> req = parse_responses_request({"model": "m", "instructions": "Be brief.", "input": [
    ...     {"role": "user", "content": "2+3?"},
    ...     {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
    ...     {"type": "function_call_output", "call_id": "c1", "output": "5"}],
    ...     "tools": [{"type": "function", "name": "add", "strict": True,
    ...                "parameters": {"type": "object", "title": "add_args", "additionalProperties": False}}]})
    >>> [(m.role, m.content, [c.name for c in m.tool_calls]) for m in req.messages]
    [('system', 'Be brief.', []), ('user', '2+3?', []), ('assistant', '', ['add']), ('tool', '5', [])]
    >>> req.tools_json, req.instructions, req.api
    ('[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]', True, 'responses')
    """
    body = _dict(body, "body")
    model = _str(body.get("model"), "model", limit=MAX_MODEL_CHARS, empty=False)
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise BadRequest(why, param=name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    instructions = body.get("instructions")
    head = []
    if instructions is not None:
        head = [
            common_pb2.ChatMessage(
                role="system", content=_str(instructions, "instructions", limit=MAX_TEXT_CHARS)
            )
        ]
    if body.get("input") is None:
        raise BadRequest("input is required: a string or an array of items", param="input")
    messages = [*head, *_items(body["input"])]
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"input has more than {MAX_MESSAGES} messages", param="input")
    previous = body.get("previous_response_id")
    if previous is not None:
        previous = _str(previous, "previous_response_id", limit=MAX_MODEL_CHARS, empty=False)
    elif not messages:
        raise BadRequest("input must not be empty", param="input")
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tool_names(tools))
    return ChatRequest(
        messages=messages,
        tools_json=tools,
        max_tokens=_max_output_tokens(body),
        model=model,
        stream=bool(stream),
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel_tool_calls(body),
        json_schema=_answer_schema(body),
        prefix_keys=history.prefix_keys(messages),
        api=RESPONSES,
        previous_response_id=previous or "",
        instructions=bool(head),
        malformed_as_calls=malformed_as_calls(body),
    )


# -- the answer --------------------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def output_items(answer: Answer) -> list[dict[str, Any]]:
    """The answer's output items: a message with its text (when it has any), then its calls.

    >>> msg = common_pb2.ChatMessage(role="assistant", content="Adding.", tool_calls=[
    ...     common_pb2.ToolCall(id="call_0_0", name="add", arguments_json="{}", parse=common_pb2.TOOL_CALL_PARSE_OK)])
    >>> [(i["type"], i.get("call_id")) for i in output_items(Answer(msg, "tool_calls", 3, 4))]
    [('message', None), ('function_call', 'call_0_0')]
    """
    status = "incomplete" if answer.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if answer.message.content or not answer.message.tool_calls:
        part = {"type": "output_text", "text": answer.message.content, "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": _item_id("msg"),
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        )
    for c in answer.message.tool_calls:
        item = {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": c.id,
            "name": c.name,
            "arguments": c.arguments_json,
            "status": "completed",
        }
        if c.parse in PARSE_ERRORS:
            item["relayrl_parse_error"] = PARSE_ERRORS[c.parse]
        items.append(item)
    return items


def _usage(answer: Answer) -> dict[str, Any]:
    return {
        "input_tokens": answer.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": answer.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def response_json(answer: Answer, body: dict, model: str, output: list[dict] | None = None) -> dict[str, Any]:
    """The ``response`` object of an answer, echoing the request's settings as OpenAI does."""
    cut = answer.finish_reason == "length"
    return {
        "id": answer.id,
        "object": "response",
        "created_at": answer.created,
        "status": "incomplete" if cut else "completed",
        "completed_at": None if cut else answer.created,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output_items(answer) if output is None else output,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": None,
        "store": body.get("store") is not False,
        "temperature": None,
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": None,
        "truncation": body.get("truncation") or "disabled",
        "usage": _usage(answer),
        "metadata": body.get("metadata") or {},
    }


def stream_events(answer: Answer, body: dict, model: str) -> list[dict[str, Any]]:
    """The events that stream an answer, in order (the server frames each as ``event: <type>``
    and ``data: <json>``). The generator answers whole: each text or arguments comes in one
    delta. The last event's ``response`` is what ``response_json`` returns.

    >>> a = Answer(common_pb2.ChatMessage(role="assistant", content="5"), "stop", 7, 2, "resp_1", 5)
    >>> [e["type"] for e in stream_events(a, {}, "m")]  # doctest: +NORMALIZE_WHITESPACE
    ['response.created', 'response.in_progress', 'response.output_item.added',
     'response.content_part.added', 'response.output_text.delta', 'response.output_text.done',
     'response.content_part.done', 'response.output_item.done', 'response.completed']
    """
    items = output_items(answer)
    final = response_json(answer, body, model, items)
    start = {**final, "status": "in_progress", "output": [], "usage": None, "completed_at": None,
             "incomplete_details": None}  # fmt: skip
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
    ]
    for i, item in enumerate(items):
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            events += [
                {"type": "response.output_item.added", "output_index": i,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **where, "content_index": 0, "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text, "logprobs": []},
                {"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]  # fmt: skip
        else:
            args = item["arguments"]
            events += [
                {"type": "response.output_item.added", "output_index": i,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **where, "delta": args},
                {"type": "response.function_call_arguments.done", **where, "name": item["name"], "arguments": args},
            ]  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": "response.incomplete" if final["status"] == "incomplete" else "response.completed",
                   "response": final})  # fmt: skip
    for n, e in enumerate(events):
        e["sequence_number"] = n
    return events


def event_frames(events: list[dict[str, Any]]) -> list[bytes]:
    """Server-sent event frames: ``event: <type>`` then the JSON, as OpenAI frames them."""
    return [f"event: {e['type']}\ndata: ".encode() + json.dumps(e).encode() + b"\n\n" for e in events]
