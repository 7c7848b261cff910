"""What the engine enforces while it samples, as a structural tag for vLLM's structured output
(xgrammar), which masks every token that would leave the format: ``SamplingParams.tool_choice``
REQUIRED (one or more calls of the prompt's tools) and FUNCTION (one call of a named tool), and
``SamplingParams.json_schema`` (the answer is JSON of a schema, or, where the prompt has tools,
calls of them instead).

In: the prompt's tools (OpenAI function schemas), the tool format, the choice, the schema. Out:
the structural tag as JSON text (``PromptIn.constraint``; ``output_constraint``). Calls are
written in the model's own call syntax, the one its chat template renders and ``toolcalls.py``
reads back:

- ``hermes``: ``<tool_call>\\n{"name": "<tool>", "arguments": <object>}\\n</tool_call>``, calls
  separated by a newline;
- ``llama3_json``: ``{"name": "<tool>", "parameters": <object>}``, one call per turn.

Each call's arguments follow its tool's ``parameters`` schema; a schema the grammar compiler
cannot take (checked here when xgrammar is installed) becomes a plain JSON object for that tool
(or answer), so a request never fails on a schema feature. Nothing else may be written around
the calls or the answer, and once they are done the only tokens left are the request's stop
tokens: the turn ends there.

Pure functions; the tokens stay the sampled ones (the constraint only masks), so training on
them is exact.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from relayrl.common.rpc import InvalidRequest, bounded

logger = logging.getLogger(__name__)

REQUIRED, FUNCTION = "required", "function"
CHOICES = ("", REQUIRED, FUNCTION)
"""``SamplingSpec.tool_choice``: "" (free), "required", "function"."""
MAX_WHITESPACE = 4
"""Most whitespace characters in a row inside a call's JSON: room for indentation, none for a
model that would fill its budget with newlines (what an untrained model does under a grammar)."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_CALL_SYNTAX = {
    # format: (text before the arguments, with {name} as JSON; after them; between calls; one only)
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n", False),
    "llama3_json": ('{{"name": {name}, "parameters": ', "}", "", True),
}


def output_constraint(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_format: str,
    choice: str,
    function: str = "",
    single: bool = False,
    json_schema: str = "",
) -> str:
    """The structural tag (JSON text) a completion must follow, "" for none: the calls of
    ``tool_call_constraint`` under a tool ``choice``; else with a ``json_schema``, an answer of
    that schema, or calls of the tools where the prompt has some and a ``tool_format`` reads
    them.

    >>> output_constraint(None, "hermes", "")
    ''
    >>> json.loads(output_constraint(None, "", "", json_schema='{"type": "object"}'))["format"]["type"]
    'json_schema'
    """
    if choice:
        return tool_call_constraint(tools or [], tool_format, choice, function, single)
    if not json_schema:
        return ""
    answer = _json_format(json.loads(json_schema))
    if tools and tool_format in _CALL_SYNTAX:
        answer = {"type": "or", "elements": [_calls_format(tools, tool_format, REQUIRED), answer]}
    return json.dumps({"type": "structural_tag", "format": answer}, ensure_ascii=False)


def tool_call_constraint(
    tools: Sequence[Mapping[str, Any]],
    tool_format: str,
    choice: str,
    function: str = "",
    single: bool = False,
) -> str:
    """The structural tag (JSON text) that makes a completion one or more calls of ``tools``
    (``choice`` "required"; at most one with ``single``, or where the format allows one) or one
    call of ``function`` ("function"). ``InvalidRequest`` names what is missing.

    >>> tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    >>> tag = json.loads(tool_call_constraint(tools, "hermes", "function", "calc"))
    >>> fmt = tag["format"]
    >>> fmt["type"], fmt["at_least_one"], fmt["stop_after_first"], fmt["tags"][0]["begin"]
    ('tags_with_separator', True, True, '<tool_call>\\n{"name": "calc", "arguments": ')
    >>> tool_call_constraint(tools, "hermes", "function", "search")
    Traceback (most recent call last):
    ...
    relayrl.common.rpc.InvalidRequest: sampling.tool_choice_function 'search' is not one of the prompt's tools (calc)
    """
    if choice not in (REQUIRED, FUNCTION):
        raise ValueError(f"no constraint for tool choice {choice!r}")
    fmt = _calls_format(tools, tool_format, choice, function, single)
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _calls_format(
    tools: Sequence[Mapping[str, Any]],
    tool_format: str,
    choice: str,
    function: str = "",
    single: bool = False,
) -> dict[str, Any]:
    if tool_format not in _CALL_SYNTAX:
        raise InvalidRequest(
            "sampling.tool_choice needs sampling.tool_format (how the model writes calls: "
            f"{', '.join(_CALL_SYNTAX)})"
        )
    names = [_name(t) for t in tools]
    if not names:
        raise InvalidRequest("sampling.tool_choice needs a prompt with tools (tools_json)")
    if choice == FUNCTION:
        if function not in names:
            raise InvalidRequest(
                f"sampling.tool_choice_function {bounded(function, 80)!r} is not one of the prompt's "
                f"tools ({bounded(', '.join(names), 200)})"
            )
        chosen = [t for t in tools if _name(t) == function][:1]
    else:
        chosen = list(tools)
    before, after, separator, one_only = _CALL_SYNTAX[tool_format]
    tags = [
        {
            "type": "tag",
            "begin": before.format(name=json.dumps(_name(t), ensure_ascii=False)),
            "content": _json_format(_parameters(t), _name(t)),
            "end": after,
        }
        for t in chosen
    ]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator or "\n",
        "at_least_one": True,
        "stop_after_first": choice == FUNCTION or single or one_only,
    }


def _json_format(schema: Any, what: str = "the answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": _schema(schema, what), "max_whitespace_cnt": MAX_WHITESPACE}


def _name(tool: Mapping[str, Any]) -> str:
    fn = tool.get("function", tool)
    return str(fn.get("name", "")) if isinstance(fn, Mapping) else ""


def _parameters(tool: Mapping[str, Any]) -> Any:
    fn = tool.get("function", tool)
    return fn.get("parameters") if isinstance(fn, Mapping) else None


def _schema(schema: Any, what: str) -> Any:
    """``schema`` when the grammar compiler takes it, else any JSON object (``what`` is logged:
    a tool's name, or "the answer")."""
    if not isinstance(schema, Mapping) or not schema:
        return ANY_OBJECT
    text = json.dumps(schema)  # key order kept: the grammar writes properties in the schema's order
    if not _compiles(text):
        logger.warning(
            "%s: its JSON schema does not compile as a grammar; constrained to any JSON object instead",
            bounded(repr(what), 80),
        )
        return ANY_OBJECT
    return json.loads(text)


@functools.lru_cache(maxsize=1024)
def _compiles(schema_json: str) -> bool:
    """Whether xgrammar builds a grammar from this JSON schema (True where xgrammar is not
    installed: vLLM then reports what it cannot take)."""
    try:
        import xgrammar as xgr
    except ImportError:
        return True
    try:
        xgr.Grammar.from_json_schema(schema_json)
    except Exception:  # xgrammar raises several types for schemas it does not support
        return False
    return True
