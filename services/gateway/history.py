r"""Canonical keys of chat messages, for matching an agent's history against a session's calls
(``sessions.py``) in time linear in the request's size, and the canonical form of tool schemas.

A message's key is a digest of its meaning: its role, its content and its tool calls (name, and
arguments as a canonical JSON text: key order, spacing and number spelling gone, since an agent
may re-serialize them). Ids are the agent's own and left out. Frameworks re-send the model's
turns in other forms, and an assistant message's key is read through them: its text without
the whitespace around it (agents strip it), and calls written out as text (smolagents re-sends
an answer's calls as ``Calling tools:\n[{...}]``, a Python literal of OpenAI-style calls) read
as calls. Matching never re-renders a matched turn: the session extends its exact tokens, so a
re-sent turn only has to mean what the model wrote. The prefix key
of ``messages[:n]`` chains the keys of its ``n`` messages, so one pass over a request gives the
key of each of its prefixes, and a session finds the longest call its request extends with one
dictionary lookup per message, however many calls it made: each argument text is parsed once per
request, never once per stored call.

Keys are BLAKE2b digests of length-prefixed fields: two different messages get one key only by a
collision of a 256-bit hash."""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from relayrl.common.v1 import common_pb2

DIGEST_BYTES = 32
TEXT_CALLS = "Calling tools:\n"
"""What smolagents writes before the calls of an earlier answer it re-sends as text."""
MAX_TEXT_CALLS_CHARS = 256 << 10
"""Longest text read for calls (a Python literal, parsed with ``ast.literal_eval``)."""


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent, by value: an integral one as an int, so ``1.0``
    and ``1`` are one number (as they are to Python, and as JavaScript writes them)."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def canonical_arguments(text: str) -> str:
    """``text`` as one spelling per JSON value: objects with sorted keys, no spaces, numbers by
    value; a text that is not strict JSON (or holds NaN or Infinity, which are not) is kept as
    it is, marked apart, so it only equals itself.

    >>> canonical_arguments('{"b": [2, 1.0], "a": "x"}') == canonical_arguments('{"a":"x","b":[2,1]}')
    True
    >>> canonical_arguments('{"a": 1}') == canonical_arguments('{"a": 2}'), canonical_arguments("<x")
    (False, 't<x')
    >>> canonical_arguments('{"a": true}') == canonical_arguments('{"a": 1}')  # a bool is no number
    False
    """
    try:
        value = json.loads(text, parse_float=_number, parse_constant=_not_json)
        return "j" + json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return "t" + text


def _field(h, text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def text_calls(content: str) -> tuple[str, list[tuple[str, str]]] | None:
    r"""``(text, [(name, arguments JSON)])`` of an assistant turn whose calls are written out as
    smolagents re-sends them (``Calling tools:\n`` and a Python literal list of OpenAI-style
    calls, arguments an object or its JSON text), None for any other text. Parsed with
    ``ast.literal_eval`` (literals only, never code), bounded.

    >>> text_calls("Let me add.\nCalling tools:\n[{'id': 'c', 'type': 'function', "
    ...            "'function': {'name': 'add', 'arguments': {'a': 1}}}]")
    ('Let me add.', [('add', '{"a": 1}')])
    >>> text_calls("Calling tools:\n[{'function': {'name': 'add', 'arguments': __import__('os')}}]") is None
    True
    """
    at = content.rfind(TEXT_CALLS)
    literal = content[at + len(TEXT_CALLS) :] if at >= 0 else ""
    if not literal or len(literal) > MAX_TEXT_CALLS_CHARS:
        return None
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            return None
        args = fn.get("arguments", {})
        try:
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return None
        calls.append((name, text))
    return content[:at].strip(), calls


def message_key(m: common_pb2.ChatMessage) -> bytes:
    r"""The digest of what ``m`` means to the model: role, content, and each tool call's name
    and canonical arguments; an assistant's content without surrounding whitespace, and with
    calls written out as text (``text_calls``) read as calls.

    >>> a = common_pb2.ChatMessage(role="assistant", tool_calls=[
    ...     common_pb2.ToolCall(id="call_1", name="calc", arguments_json='{"expression": "2*3"}')])
    >>> b = common_pb2.ChatMessage(role="assistant", tool_calls=[
    ...     common_pb2.ToolCall(id="mine", name="calc", arguments_json='{"expression":"2*3"}')])
    >>> message_key(a) == message_key(b), message_key(a) == message_key(b.__class__(role="assistant"))
    (True, False)
    >>> as_text = common_pb2.ChatMessage(role="assistant", content=(
    ...     "Calling tools:\n[{'id': 'x', 'type': 'function', 'function': {'name': 'calc', "
    ...     "'arguments': {'expression': '2*3'}}}]"))
    >>> message_key(as_text) == message_key(a)
    True
    """
    content = m.content
    calls = [(c.name, c.arguments_json) for c in m.tool_calls]
    if m.role == "assistant":
        content = content.strip()
        if not calls and TEXT_CALLS in content and (written := text_calls(content)) is not None:
            content, calls = written
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _field(h, m.role)
    _field(h, content)
    h.update(len(calls).to_bytes(8, "little"))
    for name, arguments in calls:
        _field(h, name)
        _field(h, canonical_arguments(arguments))
    return h.digest()


def extend(prefix: bytes, key: bytes) -> bytes:
    """The prefix key of a history ``prefix`` stands for, followed by the message of ``key``."""
    return hashlib.blake2b(prefix + key, digest_size=DIGEST_BYTES).digest()


def prefix_keys(messages: Sequence[common_pb2.ChatMessage]) -> tuple[bytes, ...]:
    """``out[i]``: the key of ``messages[: i + 1]``; one pass, linear in the messages' size.

    >>> user, other = common_pb2.ChatMessage(role="user", content="hi"), common_pb2.ChatMessage(role="user")
    >>> a, b = prefix_keys([user, other]), prefix_keys([user, user])
    >>> a[0] == b[0], a[1] == b[1], len(a[0])
    (True, False, 32)
    """
    out, key = [], b""
    for m in messages:
        key = extend(key, message_key(m))
        out.append(key)
    return tuple(out)


# -- tool schemas ---------------------------------------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Schema keywords whose value maps names to schemas (the names are data, never keywords)."""
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")  # fmt: skip


def plain_schema(schema: Any) -> Any:
    """A JSON schema without what frameworks add for OpenAI's strict mode and pydantic's
    annotations: ``title`` keywords and boolean ``additionalProperties``. A property named
    "title" stays (names are data); everything else, key order included, is kept.

    >>> plain_schema({"title": "calc_args", "type": "object", "additionalProperties": False,
    ...               "properties": {"title": {"title": "Title", "type": "string"}}})
    {'type': 'object', 'properties': {'title': {'type': 'string'}}}
    """
    if isinstance(schema, list):
        return [plain_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if (k == "title" and isinstance(v, str)) or (k == "additionalProperties" and isinstance(v, bool)):
            continue
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: plain_schema(sub) for name, sub in v.items()}
        elif k in _SCHEMA_LISTS or k in _SCHEMA_ONE:
            out[k] = plain_schema(v)
        else:
            out[k] = v
    return out


def plain_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat tool (``{"type": "function", "function": {...}}``) as the model is shown
    it: without the API's ``strict`` flag, its ``parameters`` a ``plain_schema``.

    >>> plain_tool({"type": "function", "function": {"name": "f", "strict": True,
    ...             "parameters": {"type": "object", "title": "f_args"}}})
    {'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object'}}}
    """
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return tool
    fn = {k: (plain_schema(v) if k == "parameters" else v) for k, v in fn.items() if k != "strict"}
    return {**tool, "function": fn}


def tools_key(tools_json: str) -> str:
    """A key equal for two ``tools_json`` texts that list the same tools, whatever their key
    order or spacing ("" for none).

    >>> tools_key('[{"a": 1, "b": 2}]') == tools_key('[{"b":2,"a":1}]') != tools_key("")
    True
    """
    if not tools_json:
        return ""
    return canonical_arguments(tools_json)
