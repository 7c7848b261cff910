"""MCP environments of OpenEnv (``MCPEnvironment``, served with ``CallToolAction``): how their
Action schema is told apart, their listed tools become the model's, and a ``call_tool``
observation becomes the tool's answer (``relayrl.env.openenv`` plays them).

The server is not trusted to be small: its tool list goes into every prompt and every Reset
answer, so it is bounded (tools, names, schema size and depth) and refused whole, naming why,
when it is not."""

from __future__ import annotations

import json
import re
from typing import Any

from relayrl.env.base import ToolStatus

MCP_ERRORS = {
    "invalid_args": ToolStatus.INVALID_ARGS,
    "tool_not_found": ToolStatus.UNKNOWN_TOOL,
    "timeout": ToolStatus.TIMEOUT,
    "execution_error": ToolStatus.CRASHED,
}
"""An MCP tool's errors (``ToolError.error_type``) answered to the model. OpenEnv's server files
every exception of a call under one of these by its message (its own MCP client's failures too);
only ``transport_error``, or an error type this does not know, is the env's failure (redone)."""
MCP_ACTIONS = ("CallToolAction", "ListToolsAction", "MCPAction")
MAX_MCP_TOOLS = 128
MAX_SCHEMA_CHARS = 16 << 10
"""Largest input schema of one tool, as JSON."""
MAX_TOOLS_CHARS = 256 << 10
"""Largest tool list, as JSON: it is part of every prompt."""
MAX_SCHEMA_DEPTH = 32
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI's function names allow."""
NAME_MAPS = ("properties", "$defs", "definitions", "patternProperties")
"""Schema keys whose values map names to schemas: a name there is never a keyword."""
VALUES = ("default", "const", "enum", "examples")
"""Schema keys whose values are data, kept as they are."""


def is_mcp(schema: dict) -> bool:
    """Whether a server's Action schema is MCP's (its env offers tools of its own): one of MCP's
    actions, or a union of them.

    >>> is_mcp({"title": "CallToolAction"}), is_mcp({"title": "GuessAction"})
    (True, False)
    >>> is_mcp({"oneOf": [{"$ref": "#/$defs/ListToolsAction"}, {"title": "CallToolAction"}]})
    True
    """
    kind = (schema.get("properties") or {}).get("type")
    if schema.get("title") in MCP_ACTIONS or (isinstance(kind, dict) and kind.get("const") == "call_tool"):
        return True
    union = [s for key in ("oneOf", "anyOf") for s in schema.get(key) or [] if isinstance(s, dict)]
    names = {s.get("title") or str(s.get("$ref", "")).rsplit("/", 1)[-1] for s in union}
    return bool(names) and names <= set(MCP_ACTIONS)


def untitled(schema: Any, depth: int = 0) -> Any:
    """``schema`` without pydantic's ``title`` keys (tokens in every prompt, no meaning); a
    property or definition named "title", and data (defaults, enums), stay. ValueError past
    ``MAX_SCHEMA_DEPTH`` levels.

    >>> untitled({"title": "A", "properties": {"title": {"title": "Title", "type": "string"}}})
    {'properties': {'title': {'type': 'string'}}}
    >>> untitled({"type": "object", "default": {"title": "x"}})
    {'type': 'object', 'default': {'title': 'x'}}
    """
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"a schema nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, list):
        return [untitled(v, depth + 1) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "title":
            continue
        if k in NAME_MAPS and isinstance(v, dict):
            out[k] = {name: untitled(d, depth + 1) for name, d in v.items()}
        else:
            out[k] = v if k in VALUES else untitled(v, depth + 1)
    return out


def mcp_tool(tool: Any) -> dict:
    """The OpenAI function schema of one MCP tool of a ``list_tools`` observation (ValueError
    when it is not one, or is too large)."""
    if not isinstance(tool, dict) or not TOOL_NAME.match(str(tool.get("name", ""))):
        raise ValueError(f"not an MCP tool with a plain name (letters, digits, _ and -): {str(tool)[:200]}")
    params = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValueError(f"MCP tool {tool['name']}: its input schema is not an object")
    params = untitled(params)
    if len(json.dumps(params)) > MAX_SCHEMA_CHARS:
        raise ValueError(f"MCP tool {tool['name']}: its input schema is over {MAX_SCHEMA_CHARS} characters")
    text = str(tool.get("description") or f"The environment's {tool['name']} tool.")[:2000]
    return {"type": "function", "function": {"name": tool["name"], "description": text, "parameters": params}}


def mcp_tools(listed: Any) -> list[dict]:
    """The model's tools from a ``list_tools`` observation's ``tools`` (ValueError naming what is
    wrong: none, too many, a bad or repeated name, too large).

    >>> [t["function"]["name"] for t in mcp_tools([{"name": "calc", "input_schema": {"type": "object"}}])]
    ['calc']
    >>> mcp_tools([{"name": "a"}, {"name": "a"}])
    Traceback (most recent call last):
    ...
    ValueError: list_tools named a tool twice: a
    """
    if not isinstance(listed, list) or not 0 < len(listed) <= MAX_MCP_TOOLS:
        n = len(listed) if isinstance(listed, list) else "no"
        raise ValueError(
            f"list_tools gave {n} tools (1..{MAX_MCP_TOOLS} wanted; OpenEnv's server answers none "
            "when listing failed there: see its log)"
        )
    tools = [mcp_tool(t) for t in listed]
    names = [t["function"]["name"] for t in tools]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"list_tools named a tool twice: {', '.join(twice)[:200]}")
    if len(json.dumps(tools)) > MAX_TOOLS_CHARS:
        raise ValueError(f"list_tools gave over {MAX_TOOLS_CHARS} characters of tools")
    return tools


def mcp_answer(observation: Any) -> tuple[ToolStatus, str] | None:
    """What a ``call_tool`` observation answers the model: (status, text), or None when it says
    the env failed (``transport_error``, an unknown error type, no observation at all).

    >>> mcp_answer({"result": {"content": [{"type": "text", "text": "408"}], "is_error": False}})
    (<ToolStatus.OK: 'ok'>, '408')
    >>> mcp_answer({"result": {"content": [{"type": "text", "text": "boom"}], "isError": True}})
    (<ToolStatus.CRASHED: 'crashed'>, 'error: boom')
    >>> mcp_answer({"result": None, "error": {"error_type": "tool_not_found", "message": "Unknown tool: 'x'"}})
    (<ToolStatus.UNKNOWN_TOOL: 'unknown_tool'>, "error: Unknown tool: 'x'")
    >>> mcp_answer({"error": {"error_type": "transport_error", "message": "down"}}) is None
    True
    """
    if not isinstance(observation, dict):
        return None
    error = observation.get("error")
    if isinstance(error, dict):
        status = MCP_ERRORS.get(str(error.get("error_type")))
        return None if status is None else (status, f"error: {str(error.get('message', ''))[:2000]}")
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        parts = [
            str(c.get("text", "")) if c.get("type") == "text" else f"[{str(c.get('type', 'content'))[:40]}]"
            for c in result["content"]
            if isinstance(c, dict)
        ]
        text = "\n".join(parts)
        failed = result.get("is_error") or result.get("isError")  # fastmcp's field, MCP's own
        return (ToolStatus.CRASHED, f"error: {text}") if failed else (ToolStatus.OK, text)
    if isinstance(result, str):
        return ToolStatus.OK, result
    return ToolStatus.OK, json.dumps(result, ensure_ascii=False, default=str)
