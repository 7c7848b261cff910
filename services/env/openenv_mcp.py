"""MCP environments of OpenEnv (``MCPEnvironment``, served with ``CallToolAction``): how their
Action schema is told apart, their listed tools become the model's, and a ``call_tool``
observation becomes the tool's answer (``relayrl.env.openenv`` plays them)."""

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
"""An MCP tool's errors (``ToolError.error_type``) that the model's call caused: answered to it;
any other (``transport_error``) is the env's."""
MCP_ACTIONS = ("CallToolAction", "ListToolsAction")
MAX_MCP_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def is_mcp(schema: dict) -> bool:
    """Whether a server's Action schema is MCP's (its env offers tools of its own).

    >>> is_mcp({"title": "CallToolAction"}), is_mcp({"title": "GuessAction"})
    (True, False)
    """
    kind = (schema.get("properties") or {}).get("type")
    return schema.get("title") in MCP_ACTIONS or (isinstance(kind, dict) and kind.get("const") == "call_tool")


def untitled(schema: Any) -> Any:
    """``schema`` without pydantic's ``title`` keys (tokens in every prompt, no meaning); a
    property named "title" stays.

    >>> untitled({"title": "A", "properties": {"title": {"title": "Title", "type": "string"}}})
    {'properties': {'title': {'type': 'string'}}}
    """
    if isinstance(schema, list):
        return [untitled(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        k: (
            {p: untitled(d) for p, d in v.items()}
            if k == "properties" and isinstance(v, dict)
            else untitled(v)
        )
        for k, v in schema.items()
        if k != "title"
    }


def mcp_tool(tool: Any) -> dict:
    """The OpenAI function schema of one MCP tool of a ``list_tools`` observation (ValueError
    when it is not one)."""
    if not isinstance(tool, dict) or not TOOL_NAME.match(str(tool.get("name", ""))):
        raise ValueError(f"not an MCP tool with a plain name: {str(tool)[:200]}")
    params = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValueError(f"MCP tool {tool['name']}: its input schema is not an object")
    text = str(tool.get("description") or f"The environment's {tool['name']} tool.")[:2000]
    return {
        "type": "function",
        "function": {"name": tool["name"], "description": text, "parameters": untitled(params)},
    }


def mcp_answer(observation: dict) -> tuple[ToolStatus, str] | None:
    """What a ``call_tool`` observation answers the model: (status, text), or None when the
    server's MCP client failed (the env's failure, not the call's).

    >>> mcp_answer({"result": {"content": [{"type": "text", "text": "408"}], "is_error": False}})
    (<ToolStatus.OK: 'ok'>, '408')
    >>> mcp_answer({"result": None, "error": {"error_type": "tool_not_found", "message": "Unknown tool: 'x'"}})
    (<ToolStatus.UNKNOWN_TOOL: 'unknown_tool'>, "error: Unknown tool: 'x'")
    >>> mcp_answer({"error": {"error_type": "transport_error", "message": "down"}}) is None
    True
    """
    error = observation.get("error")
    if isinstance(error, dict):
        status = MCP_ERRORS.get(str(error.get("error_type")))
        return None if status is None else (status, f"error: {str(error.get('message', ''))[:2000]}")
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        parts = [
            str(c.get("text", ""))
            if isinstance(c, dict) and c.get("type") == "text"
            else f"[{c.get('type', 'content')}]"
            if isinstance(c, dict)
            else str(c)
            for c in result["content"]
        ]
        text = "\n".join(parts)
        return (ToolStatus.CRASHED, f"error: {text}") if result.get("is_error") else (ToolStatus.OK, text)
    if isinstance(result, str):
        return ToolStatus.OK, result
    return ToolStatus.OK, json.dumps(result, ensure_ascii=False, default=str)
