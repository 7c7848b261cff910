"""OpenEnv environments (Meta/Hugging Face's standard, ``openenv``) served by their own servers,
played over OpenEnv's own WebSocket protocol: one session (``/ws``) per episode.

Why a server and not the class in this process: OpenEnv runs an env as a server (a container, an
HF Space, ``uvicorn server.app:app``), and its packages cannot share an environment with the
generator's (openenv 0.10 pins fastmcp 3, which needs mcp < 2; vLLM 0.32 needs mcp >= 2). The
env service needs no ``openenv`` package at all: it speaks the wire protocol, which every release
since 0.2.0 serves (``{"type": "reset" | "step" | "state" | "close", "data": ...}`` in,
``{"type": "observation", "data": {"observation", "reward", "done"}}`` or ``{"type": "error"}``
out).

The episode: ``reset(seed, episode_id, **row)`` (the server passes on the keywords its env's
``reset`` takes); the first observation is appended to the row's prompt. The model acts by calling
one tool whose arguments are the env's Action (its JSON schema from the server's ``/schema``,
named after the Action class: ``GuessAction`` -> ``guess``); each call is one ``step``, its
observation the tool's answer. The episode ends when an observation says ``done``, or at a turn
without tool calls. Its reward is the sum of the rewards its observations carried, the reset's
included (a model that gives up at once scores what the env says of that); an episode whose
observations carried none is masked (``no_reward``), never scored 0. An Action the server refuses
(``VALIDATION_ERROR``) or a step that raises (``EXECUTION_ERROR``) is answered to the model as a
tool error and the episode goes on; a server that cannot be reached, is full or breaks the
session is the env's failure: the episode is redone, never scored.

MCP environments (``MCPEnvironment``, served with ``CallToolAction``: openenv-core >= 0.2.3) offer
tools of their own instead of one Action: the replica lists them at start (a ``list_tools`` step
on a session of its own) and offers each to the model under its own name and input schema. A call
is a ``call_tool`` step; the tool's text content is the answer. The errors the server files under
``invalid_args``, ``tool_not_found``, ``execution_error`` or ``timeout`` are answered to the model
(OpenEnv's server files every exception of a call there by its message, its own MCP client's
failures too: those reach the model as the tool's error); ``transport_error``, an error type not
known here, or a broken session is the env's failure, as above. A call waits at most
``tool_timeout_seconds`` (10 s by default, under the server's own 30 s): past it the episode is
redone. Rewards and ``done`` come from the observations, as for any OpenEnv environment.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from typing import Any, ClassVar

from relayrl.env.base import (
    Action,
    Env,
    EnvUnavailable,
    Outcome,
    Reward,
    StepAnswer,
    ToolResult,
    ToolStatus,
    prompt_messages,
)
from relayrl.env.openenv_mcp import is_mcp, mcp_answer, mcp_tools, untitled

RESERVED = ("reward", "done", "metadata")
"""Observation fields the wire protocol carries beside the observation, not in it."""
MODEL_ERRORS = {"VALIDATION_ERROR": ToolStatus.INVALID_ARGS, "EXECUTION_ERROR": ToolStatus.CRASHED}
"""Server error codes that are the model's doing (a bad Action): answered to the model."""


def ws_url(url: str) -> str:
    """The session endpoint of an OpenEnv server at ``url``.

    >>> ws_url("http://127.0.0.1:8000/")
    'ws://127.0.0.1:8000/ws'
    >>> ws_url("https://env.example/space")
    'wss://env.example/space/ws'
    """
    base = url.rstrip("/")
    return "ws" + base[len("http") :] + "/ws" if base.startswith("http") else base + "/ws"


def tool_name(schema: dict) -> str:
    """The tool's name: the Action class's, in snake case, without "Action".

    >>> tool_name({"title": "GuessAction"}), tool_name({"title": "CodeAction"}), tool_name({})
    ('guess', 'code', 'act')
    """
    title = re.sub(r"Action$", "", str(schema.get("title") or "")) or "act"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", title).lower()


def action_tool(schema: dict, description: str = "") -> dict:
    """The OpenAI function schema of an Action's JSON schema: its fields but ``metadata``."""
    params = {k: v for k, v in schema.items() if k not in ("title", "description")}
    # pydantic titles every field ("number" -> "Number"): tokens in every prompt, no meaning.
    props = {k: untitled(v) for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    params.update(type="object", properties=props)
    params["required"] = [r for r in schema.get("required") or [] if r in props]
    text = (
        description
        or schema.get("description")
        or f"Act in the environment ({schema.get('title', 'Action')})."
    )
    return {
        "type": "function",
        "function": {"name": tool_name(schema), "description": text, "parameters": params},
    }


def render(data: dict) -> str:
    """What the model reads of an observation: its one text field, else its fields as JSON.

    >>> render({"observation": {"text": "Higher.", "hint": None}, "reward": 0.0})
    'Higher.'
    >>> render({"observation": {"echoed": "hi", "length": 2}})
    '{"echoed": "hi", "length": 2}'
    """
    obs = {
        k: v for k, v in (data.get("observation") or {}).items() if k not in RESERVED and v not in (None, "")
    }
    texts = [v for v in obs.values() if isinstance(v, str)]
    if len(obs) == 1 and len(texts) == 1:
        return texts[0]
    return json.dumps(obs, ensure_ascii=False, default=str) if obs else ""


def fetch_schema(url: str, timeout: float) -> dict:
    """The server's ``/schema`` (its Action's JSON schema under "action"); EnvUnavailable when it
    does not answer one within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/schema", timeout=timeout) as r:
            body = json.loads(r.read(1 << 20))
    except (OSError, ValueError) as e:
        raise EnvUnavailable(f"OpenEnv server {url}: no schema: {type(e).__name__}: {e}"[:500]) from None
    if not isinstance(body, dict) or not isinstance(body.get("action"), dict):
        raise EnvUnavailable(f"OpenEnv server {url}: /schema has no action schema")
    return body


class OpenEnvSession:
    """One WebSocket session with an OpenEnv server: an env instance of its own there."""

    def __init__(self, url: str, timeout: float):
        from websockets.sync.client import connect

        try:
            self.ws = connect(ws_url(url), open_timeout=timeout, close_timeout=2, max_size=1 << 24)
        except Exception as e:  # refused, DNS, a handshake the server turned down
            raise EnvUnavailable(
                f"OpenEnv server {url}: cannot open a session: {type(e).__name__}: {e}"[:500]
            ) from None
        self.url = url

    def call(self, kind: str, data: dict | None, timeout: float) -> dict:
        """Send one message, return the answer's ``data``; an error answer is returned as
        ``{"error": code, "message": ...}``. EnvUnavailable when the session breaks or the answer
        is not in by ``timeout``: the session is then unusable (a late answer would be misread)."""
        try:
            self.ws.send(json.dumps({"type": kind, **({"data": data} if data is not None else {})}))
            answer = json.loads(self.ws.recv(timeout=max(0.001, timeout)))
        except TimeoutError:
            raise EnvUnavailable(
                f"OpenEnv server {self.url}: no answer to {kind} in {timeout:.0f} s", "env_timeout"
            ) from None
        except Exception as e:  # closed, reset, a frame that is not JSON
            raise EnvUnavailable(
                f"OpenEnv server {self.url}: session broke in {kind}: {type(e).__name__}: {e}"[:500]
            ) from None
        body = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(body, dict):
            raise EnvUnavailable(f"OpenEnv server {self.url}: malformed answer to {kind}")
        if answer.get("type") == "error":
            message = str(body.get("message", ""))
            details = body.get("errors") if isinstance(body.get("errors"), list) else []
            for e in details[:3]:  # pydantic's: which field, and what is wrong with it
                if isinstance(e, dict):
                    where = ".".join(str(x) for x in e.get("loc") or () if x not in ("data", "body"))
                    message += f"; {where or 'action'}: {e.get('msg', '')}"
            return {"error": str(body.get("code", "")), "message": message[:2000]}
        return body

    def close(self) -> None:
        """End the session; the server frees its env and closes the socket, and is let to (a
        client that hangs up first makes the server fail its own close)."""
        try:
            self.ws.send(json.dumps({"type": "close"}))
            self.ws.recv(timeout=2)
        except Exception:  # closed by the server (the expected end), or already gone
            pass
        self.ws.close()


def list_mcp_tools(url: str, timeout: float) -> list[dict]:
    """The tools of the MCP environment at ``url`` as OpenAI function schemas, from a
    ``list_tools`` step on a session of their own; EnvUnavailable when it does not list any."""
    session = OpenEnvSession(url, timeout)
    try:
        data = session.call("step", {"type": "list_tools"}, timeout)
    finally:
        session.close()
    if "error" in data:
        raise EnvUnavailable(
            f"OpenEnv server {url}: list_tools failed: {data['error']}: {data['message']}"[:500]
        )
    observation = data.get("observation")
    try:
        return mcp_tools(observation.get("tools") if isinstance(observation, dict) else None)
    except ValueError as e:
        raise EnvUnavailable(f"OpenEnv server {url}: {e}"[:500]) from None


class OpenEnvEnv(Env):
    """An ``Env`` playing episodes on the OpenEnv server at ``url`` (set by ``openenv_env``)."""

    url: ClassVar[str] = ""
    connect_timeout: ClassVar[float] = 30.0
    mcp: ClassVar[bool] = False
    """The env offers MCP tools (each a ``call_tool`` step), not one Action."""

    def __init__(self) -> None:
        self.session: OpenEnvSession | None = None
        self.rewards: list[float] = []
        self.steps = 0
        self.over = False

    def _left(self) -> float:
        cap = self.limits.tool_timeout_seconds
        return cap if self.deadline is None else max(0.0, min(cap, self.deadline - time.monotonic()))

    def _observe(self, data: dict) -> None:
        r = data.get("reward")
        if isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r):
            self.rewards.append(float(r))
        self.over = self.over or bool(data.get("done"))

    def reset(self, task: dict, seed: int) -> list[dict]:
        messages = prompt_messages(task)
        self.session = OpenEnvSession(self.url, self.connect_timeout)
        columns = {k: v for k, v in task.items() if k != "prompt"}
        first = self.session.call("reset", {**columns, "seed": seed}, self.connect_timeout)
        if "error" in first:
            raise EnvUnavailable(
                f"OpenEnv server {self.url}: reset failed: {first['error']}: {first['message']}"[:500]
            )
        self._observe(first)  # its reward counts: an episode the model ends at once scores it
        text = render(first)
        if text and messages[-1]["role"] == "user":
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + text}
        elif text:
            messages.append({"role": "user", "content": text})
        return messages

    def step(self, action: Action) -> StepAnswer:
        if not action.tool_calls or self.session is None:
            return [], True, []
        names = [t["function"]["name"] for t in self.tools]
        messages, results = [], []
        for call in action.tool_calls:
            status, content = ToolStatus.OK, ""
            if self.over:
                status, content = ToolStatus.CRASHED, "error: the episode is over"
            elif call.parse != "ok":
                status, content = ToolStatus.PARSE_ERROR, f"error: the call did not parse ({call.parse})"
            elif call.name not in names:
                status, content = (
                    ToolStatus.UNKNOWN_TOOL,
                    f"error: no tool {call.name!r:.60}; the tools are {', '.join(map(repr, names))[:500]}",
                )
            else:
                try:
                    args = call.arguments()
                except ValueError as e:
                    status, content = ToolStatus.INVALID_ARGS, f"error: {e}"
                else:
                    status, content = self._act(call.name, args)
            if len(content) > self.limits.max_tool_output_chars:
                content = content[: self.limits.max_tool_output_chars]
                status = ToolStatus.OUTPUT_TRUNCATED if status == ToolStatus.OK else status
            messages.append({"role": "tool", "content": content, "tool_call_id": call.id, "name": call.name})
            results.append(ToolResult(call.id, call.name, status))
        return messages, self.over, results

    def _act(self, name: str, args: dict) -> tuple[ToolStatus, str]:
        """One ``step`` on the server for a call of tool ``name``: its answer to the model."""
        payload = {"type": "call_tool", "tool_name": name, "arguments": args} if self.mcp else args
        data = self.session.call("step", payload, self._left())
        if "error" in data and data["error"] in MODEL_ERRORS:
            return MODEL_ERRORS[data["error"]], f"error: {data['message']}"
        if "error" in data:
            raise EnvUnavailable(f"OpenEnv server {self.url}: {data['error']}: {data['message']}"[:500])
        answer = mcp_answer(data.get("observation")) if self.mcp else (ToolStatus.OK, render(data))
        if answer is None:
            raise EnvUnavailable(f"OpenEnv server {self.url}: tool {name}: {json.dumps(data)[:400]}")
        self.steps += 1
        self._observe(data)
        return answer[0], answer[1] or "(no observation)"

    def reward(self) -> Reward:
        if not self.rewards:
            return Reward(
                0.0, {}, Outcome.MASK, "no_reward", "the OpenEnv server gave no reward in the episode"
            )
        return Reward(sum(self.rewards), {"openenv": sum(self.rewards), "env_steps": float(self.steps)})

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def openenv_env(name: str, url: str, max_turns: int, description: str, timeout: float) -> type[Env]:
    """An ``Env`` class named ``name`` for the OpenEnv server at ``url``, its tools read from the
    server now: its MCP tools, else one from its Action schema (EnvUnavailable when the server does
    not answer in ``timeout``)."""
    schema = fetch_schema(url, timeout)["action"]
    mcp = is_mcp(schema)
    attrs: dict[str, Any] = {
        "url": url,
        "connect_timeout": timeout,
        "mcp": mcp,
        "name": name,
        "description": description or f"OpenEnv environment at {url}",
        "tools": list_mcp_tools(url, timeout) if mcp else [action_tool(schema, description)],
        "expects_tools": True,
        "max_turns": max_turns,
    }
    return type("OpenEnv_" + re.sub(r"\W", "_", name), (OpenEnvEnv,), attrs)
