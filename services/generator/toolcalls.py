"""Tool calls read out of a completion, and the form a chat template renders them from.

In: a completion's text decoded with special tokens kept (so a format that opens with a special
token, Llama-3.1's ``<|python_tag|>``, is seen), without its final end-of-turn token
(``ChatCodec.completion_text``). Out: the text outside the calls (the assistant turn's
``content``) and the calls in order, each with a ``Parse`` status; calls that did not parse are
returned too, their raw text in ``arguments_json``, so the environment can tell the model what
went wrong. Pure functions, bounded work: ``str.find`` loops (no backtracking regex), at most
``MAX_CALLS`` calls, ``json.loads`` on each block only.

Formats (``SamplingParams.tool_format``):
- ``hermes`` (Qwen2.5, Hermes, the tiny model): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, several per turn, whitespace around the JSON allowed.
- ``llama3_json`` (Llama-3.1 custom tools): an optional ``<|python_tag|>``, then one
  ``{"name": ..., "parameters": {...}}`` up to the end of the text (or ``<|eom_id|>`` /
  ``<|eot_id|>``). The template allows one call per message. Text that does not start with
  ``{`` (after the tag and whitespace) is content, not a call.

>>> content, calls = parse_tool_calls('Let me add.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>', "hermes")
>>> content, [(c.id, c.name, c.arguments_json, c.parse.name) for c in calls]
('Let me add.', [('call_0', 'add', '{"a": 1}', 'OK')])
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

FORMATS = ("hermes", "llama3_json")
"""The tool-call formats this generator reads ("" reads none)."""
MAX_CALLS = 64
"""Most calls read from one completion; text after the 64th call is left as content."""
MAX_NAME_CHARS = 128
"""Longest tool name (a longer one is MISSING_NAME)."""
MAX_RAW_CHARS = 1024
"""A call that did not parse keeps this much of its raw text, for the model's error message."""

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_ENDS = ("<|eom_id|>", "<|eot_id|>")


class Parse(IntEnum):
    """How a call was read: the values of ``relayrl.common.v1.ToolCallParse``."""

    UNSPECIFIED = 0
    OK = 1
    INVALID_JSON = 2
    UNCLOSED_BLOCK = 3
    MISSING_NAME = 4
    INVALID_ARGUMENTS = 5


@dataclass(frozen=True)
class ParsedCall:
    """One tool call (``common.v1.ToolCall``). ``arguments_json`` is a JSON object text when
    ``parse`` is OK, else the call's raw text cut to ``MAX_RAW_CHARS``; ``name`` is empty unless
    the JSON had a usable one."""

    id: str
    name: str
    arguments_json: str
    parse: Parse


def parse_tool_calls(text: str, fmt: str, id_prefix: str = "call_") -> tuple[str, list[ParsedCall]]:
    """``(content, calls)`` of a completion in format ``fmt`` (one of ``FORMATS``; "" reads no
    calls and returns the text stripped). Calls get ids ``f"{id_prefix}{k}"``, k = 0, 1, ...
    (neither format carries ids), unique within the completion."""
    if fmt == "hermes":
        return parse_hermes(text, id_prefix)
    if fmt == "llama3_json":
        return parse_llama3_json(text, id_prefix)
    if fmt == "":
        return text.strip(), []
    raise ValueError(f"unknown tool format {fmt[:40]!r}; known: {', '.join(FORMATS)}")


def parse_hermes(text: str, id_prefix: str = "call_") -> tuple[str, list[ParsedCall]]:
    """``<tool_call>{json}</tool_call>`` blocks, in order; the rest of the text is content."""
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while len(calls) < MAX_CALLS:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            break
        pieces.append(text[pos:start])
        body_at = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        cid = f"{id_prefix}{len(calls)}"
        if end < 0:  # the completion ended (or was cut) inside the block
            calls.append(ParsedCall(cid, "", _raw(text[body_at:]), Parse.UNCLOSED_BLOCK))
            pos = len(text)
            break
        calls.append(_read_call(cid, text[body_at:end], "arguments"))
        pos = end + len(HERMES_CLOSE)
    pieces.append(text[pos:])
    return "".join(pieces).strip(), calls


def parse_llama3_json(text: str, id_prefix: str = "call_") -> tuple[str, list[ParsedCall]]:
    """An optional ``<|python_tag|>`` then one JSON call up to the end (or an end token)."""
    body = text
    tagged = body.lstrip().startswith(PYTHON_TAG)
    if tagged:
        body = body.lstrip()[len(PYTHON_TAG) :]
    for end in LLAMA3_ENDS:
        if (cut := body.find(end)) >= 0:
            body = body[:cut]
    if not tagged and not body.lstrip().startswith("{"):
        return body.strip(), []  # plain text: an answer, not a call
    return "", [_read_call(f"{id_prefix}0", body, "parameters")]


def _read_call(cid: str, body: str, args_key: str) -> ParsedCall:
    r"""One call's JSON ``{"name": str, args_key: object}``; ``arguments`` is accepted as well
    (models mix the two spellings), and an arguments value that is a JSON object's text. A raw
    control character inside a string is read as itself (``strict=False``): it is unambiguous,
    and grammar-constrained sampling lets it through (xgrammar 0.2.8, strings with a length
    bound); the arguments are written back escaped.

    >>> _read_call("c", '{"name": "f", "arguments": {"s": "a' + chr(8) + '"}}', "arguments").arguments_json
    '{"s": "a\\b"}'
    """
    try:
        obj = json.loads(body, strict=False)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return ParsedCall(cid, "", _raw(body), Parse.INVALID_JSON)
    if not isinstance(obj, dict):
        return ParsedCall(cid, "", _raw(body), Parse.INVALID_JSON)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        return ParsedCall(cid, "", _raw(body), Parse.MISSING_NAME)
    args = obj.get(args_key, obj.get("arguments" if args_key != "arguments" else "parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except (ValueError, RecursionError):
            return ParsedCall(cid, name, _raw(body), Parse.INVALID_ARGUMENTS)
    if not isinstance(args, dict):
        return ParsedCall(cid, name, _raw(body), Parse.INVALID_ARGUMENTS)
    return ParsedCall(cid, name, json.dumps(args, ensure_ascii=False), Parse.OK)


def _raw(body: str) -> str:
    return body.strip()[:MAX_RAW_CHARS]


def openai_tool_call(call_id: str, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A call as chat templates read it from an assistant message's ``tool_calls``: OpenAI's
    form, arguments as a dict (Qwen2.5 and Llama-3.1 ``tojson`` them; a JSON string would be
    quoted twice)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": dict(arguments)}}
