"""Canonical keys of chat messages, for matching an agent's history against a session's calls
(``sessions.py``) in time linear in the request's size.

A message's key is a digest of what the model's tokens depend on: its role, its content and its
tool calls (name, and arguments as a canonical JSON text: key order, spacing and number spelling
gone, since an agent may re-serialize them). Ids are the agent's own and left out. The prefix key
of ``messages[:n]`` chains the keys of its ``n`` messages, so one pass over a request gives the
key of each of its prefixes, and a session finds the longest call its request extends with one
dictionary lookup per message, however many calls it made: each argument text is parsed once per
request, never once per stored call.

Keys are BLAKE2b digests of length-prefixed fields: two different messages get one key only by a
collision of a 256-bit hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from relayrl.common.v1 import common_pb2

DIGEST_BYTES = 32


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


def message_key(m: common_pb2.ChatMessage) -> bytes:
    """The digest of what the model's tokens of ``m`` depend on: role, content, and each tool
    call's name and canonical arguments.

    >>> a = common_pb2.ChatMessage(role="assistant", tool_calls=[
    ...     common_pb2.ToolCall(id="call_1", name="calc", arguments_json='{"expression": "2*3"}')])
    >>> b = common_pb2.ChatMessage(role="assistant", tool_calls=[
    ...     common_pb2.ToolCall(id="mine", name="calc", arguments_json='{"expression":"2*3"}')])
    >>> message_key(a) == message_key(b), message_key(a) == message_key(b.__class__(role="assistant"))
    (True, False)
    """
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _field(h, m.role)
    _field(h, m.content)
    h.update(len(m.tool_calls).to_bytes(8, "little"))
    for call in m.tool_calls:
        _field(h, call.name)
        _field(h, canonical_arguments(call.arguments_json))
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
