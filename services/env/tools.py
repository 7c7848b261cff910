"""Tools as Python functions: their schemas from type hints and docstrings, and running the
model's calls of them, each answered by a "tool" message the model sees.

Every call gets an answer, never an exception: a call that did not parse is PARSE_ERROR, an
unknown name UNKNOWN_TOOL, arguments that do not fit the signature (or a ``ValueError`` the tool
raises about them) INVALID_ARGS, any other exception CRASHED, a call past its time limit TIMEOUT,
an answer past ``max_tool_output_chars`` OUTPUT_TRUNCATED; a tool that knows more of its outcome
(a program it ran crashed, its output was cut) returns a ``ToolReply`` with the status. The one
exception that is not an answer is ``EnvUnavailable`` (the env's own infrastructure is down): it
is raised on, and the episode is redone. Each call runs in a thread of its own,
joined with its time limit (``Limits.tool_timeout_seconds``, and no later than the step's
deadline); a call still running then is left behind (Python cannot stop a thread), the env's
later calls are not run beside it (``ToolEnv`` ends the episode) and ``settle`` waits for it.
Inside the call, ``call_deadline()`` is when that limit ends: work the tool hands on (a sandbox
job) carries it, so that what a call left behind is dropped or killed then, and never holds a
worker that a live call needs.

``ToolEnv`` is the base of envs whose tools are methods marked ``@tool``: a turn with calls is
answered call by call and the episode goes on; a turn without calls is the final answer.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

from relayrl.env.base import (
    Action,
    Env,
    EnvUnavailable,
    Limits,
    StepAnswer,
    ToolCall,
    ToolResult,
    ToolStatus,
    Transcript,
)

MAX_ERROR_CHARS = 500
"""An error the model reads is cut to this many characters."""
_PARSE_ERRORS = {
    "invalid_json": "the tool call's body is not a JSON object",
    "unclosed_block": "the tool call has no closing tag",
    "missing_name": 'the tool call has no string "name"',
    "invalid_arguments": 'the tool call\'s "arguments" is not a JSON object',
}


def cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out.

    >>> cut("abcdef", 3)
    'abc... (3 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class ToolReply(NamedTuple):
    """A tool's answer with its status, for a tool whose outcome a return value cannot say: a
    program it ran failed (CRASHED, the verdict in ``text``), its output was cut at the tool's own
    bound (OUTPUT_TRUNCATED). The model reads ``text`` (still cut to ``max_tool_output_chars``)."""

    text: str
    status: ToolStatus = ToolStatus.OK


def tool(fn: Callable) -> Callable:
    """Mark a method of a ``ToolEnv`` as a tool the model may call (schema from its signature)."""
    fn.is_tool = True
    return fn


# ---- schemas -------------------------------------------------------------------------------


def _json_type(annotation: Any) -> dict:
    """JSON schema of a parameter's type hint (``{}`` when there is none or it has no JSON form).

    >>> _json_type(int), _json_type(list[str]), _json_type(str | None)
    ({'type': 'integer'}, {'type': 'array', 'items': {'type': 'string'}}, {'type': 'string'})
    """
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
    if annotation in simple:
        return {"type": simple[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _json_type(rest[0]) if len(rest) == 1 else {}
    if origin is typing.Literal:
        return {**_json_type(type(args[0])), "enum": list(args)}
    if origin in (list, tuple, Sequence):
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    return {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) of a Google-style docstring ("Args:" section)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description, params, section, current = [], {}, "", None
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:", "Returns:", "Raises:", "Example:", "Examples:"):
            section, current = stripped, None
            continue
        if not section:
            description.append(stripped)
        elif section in ("Args:", "Arguments:", "Parameters:") and stripped:
            head, sep, text = stripped.partition(":")
            name = head.split("(")[0].strip()
            if sep and name.isidentifier() and line.startswith((" ", "\t")) and not line.startswith(" " * 8):
                params[name], current = text.strip(), name
            elif current:
                params[current] = f"{params[current]} {stripped}".strip()
    return " ".join(x for x in description if x).strip(), params


def function_schema(fn: Callable, name: str | None = None) -> dict:
    """OpenAI-style function schema of ``fn`` from its signature, type hints and docstring.

    >>> def add(a: int, b: int = 0) -> int:
    ...     '''Add two numbers.
    ...
    ...     Args:
    ...         a: first one
    ...         b: second one
    ...     '''
    >>> s = function_schema(add)["function"]
    >>> s["name"], s["description"], s["parameters"]["required"], s["parameters"]["properties"]["b"]
    ('add', 'Add two numbers.', ['a'], {'type': 'integer', 'description': 'second one'})
    """
    hints = typing.get_type_hints(fn)
    description, docs = _docstring_parts(fn.__doc__ or "")
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        properties[p.name] = {
            **_json_type(hints.get(p.name)),
            **({"description": docs[p.name]} if p.name in docs else {}),
        }
        if p.default is p.empty:
            required.append(p.name)
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# ---- running calls -------------------------------------------------------------------------


def _check_arguments(fn: Callable, args: dict) -> None:
    """TypeError when ``args`` do not fit ``fn``: missing or unknown names, or a value whose JSON
    type is not the hint's (str, int, float, bool; other hints are not checked)."""
    inspect.signature(fn).bind(**args)
    hints = typing.get_type_hints(fn)
    for key, value in args.items():
        want = hints.get(key)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if want in (str, int, float, bool) and (type(value) is not want):
            raise TypeError(
                f"argument {key!r} must be {_json_type(want)['type']}, got {json.dumps(value)[:60]}"
            )


def render_output(value: object, max_chars: int) -> tuple[str, bool]:
    """A tool's return value as the text the model reads, cut to ``max_chars``; (text, cut?).

    >>> render_output(42, 10), render_output("x" * 12, 10)
    (('42', False), ('xxxxxxxxxx... (2 more characters)', True))
    """
    if value is None:
        text = ""
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    return (text, False) if len(text) <= max_chars else (cut(text, max_chars), True)


_CALL = threading.local()


def call_deadline() -> float | None:
    """``time.monotonic()`` at which the tool call running in this thread is given up (None
    outside a call): pass it on to work the call waits for (``Sandbox.run_sync(deadline=...)``).

    >>> call_deadline() is None
    True
    """
    return getattr(_CALL, "deadline", None)


def _run_limited(fn: Callable, args: dict, limit: float) -> tuple[str, object, threading.Thread]:
    """Run ``fn(**args)`` in a thread of its own for up to ``limit`` seconds.
    Returns ("ok", value, t), ("raised", exception, t) or ("timeout", None, t) with t still alive."""
    box: dict[str, object] = {}
    deadline = time.monotonic() + limit

    def target() -> None:
        _CALL.deadline = deadline
        try:
            box["value"] = fn(**args)
        except BaseException as e:  # a tool's SystemExit must not end anything but its call
            box["error"] = e

    t = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    t.start()
    t.join(max(0.0, limit))
    if t.is_alive():
        return "timeout", None, t
    return ("raised", box["error"], t) if "error" in box else ("ok", box.get("value"), t)


def answer_call(
    call: ToolCall, functions: dict[str, Callable], limits: Limits, deadline: float | None, strays: list
) -> tuple[str, ToolStatus]:
    """Run one call; (text the model reads, status). Never raises. A call left running past its
    limit is appended to ``strays``."""
    if call.parse != "ok":
        why = _PARSE_ERRORS.get(call.parse, "the tool call was not parsed")
        raw = f" (got: {cut(call.arguments_json, 200)})" if call.arguments_json else ""
        return f"error: {why}{raw}", ToolStatus.PARSE_ERROR
    fn = functions.get(call.name)
    if fn is None:
        known = ", ".join(sorted(functions)) or "none"
        return f"error: no tool named {cut(call.name, 128)!r}; tools: {known}", ToolStatus.UNKNOWN_TOOL
    try:
        args = call.arguments()
        _check_arguments(fn, args)
    except (TypeError, ValueError) as e:
        return f"error: {call.name}: {cut(str(e))}", ToolStatus.INVALID_ARGS
    limit = limits.tool_timeout_seconds
    if deadline is not None:
        limit = min(limit, deadline - time.monotonic())
    if limit <= 0:
        return f"error: {call.name} was not run: the turn's time is up", ToolStatus.TIMEOUT
    how, value, thread = _run_limited(fn, args, limit)
    if how == "timeout":
        strays.append(thread)
        return f"error: {call.name} ran past its time limit ({limit:.3g}s)", ToolStatus.TIMEOUT
    if how == "raised":
        if isinstance(value, EnvUnavailable):  # not the model's doing: the episode is redone
            raise value
        if isinstance(value, ValueError):  # the tool refused its arguments
            return f"error: {cut(str(value))}", ToolStatus.INVALID_ARGS
        return f"error: {call.name} failed: {cut(f'{type(value).__name__}: {value}')}", ToolStatus.CRASHED
    status = ToolStatus.OK
    if isinstance(value, ToolReply):
        value, status = value.text, ToolStatus(value.status)
    text, was_cut = render_output(value, limits.max_tool_output_chars)
    return text, ToolStatus.OUTPUT_TRUNCATED if was_cut and status == ToolStatus.OK else status


def run_tools(
    calls: Sequence[ToolCall],
    functions: dict[str, Callable],
    limits: Limits,
    deadline: float | None,
    strays: list,
) -> tuple[list[dict], list[ToolResult]]:
    """Answer ``calls`` in order: one "tool" message and one ``ToolResult`` each. After a call
    that timed out the rest are not run (TIMEOUT): nothing runs beside a call left running."""
    messages, results = [], []
    for call in calls:
        if any(r.status == ToolStatus.TIMEOUT for r in results):
            text, status = (
                f"error: {call.name or 'the call'} was not run: an earlier call timed out",
                ToolStatus.TIMEOUT,
            )
        else:
            text, status = answer_call(call, functions, limits, deadline, strays)
        messages.append({"role": "tool", "content": text, "tool_call_id": call.id, "name": call.name[:128]})
        results.append(ToolResult(call.id, call.name[:128], status))
    return messages, results


def refuse_tools(calls: Sequence[ToolCall]) -> tuple[list[dict], list[ToolResult]]:
    """Answers for calls made in an env without tools (UNKNOWN_TOOL, or PARSE_ERROR)."""
    return run_tools(calls, {}, Limits(), None, [])


def settle_threads(strays: list[threading.Thread], timeout: float) -> bool:
    """Join ``strays`` for up to ``timeout`` seconds in all; True when none is left running."""
    end = time.monotonic() + timeout
    for t in strays:
        t.join(max(0.0, end - time.monotonic()))
    strays[:] = [t for t in strays if t.is_alive()]
    return not strays


class ToolEnv(Env):
    """An env whose tools are its ``@tool`` methods. A turn with tool calls is answered call by
    call and the episode goes on; a turn without calls is the final answer (``answer``), which
    ends it. A call past its time limit ends the episode too (its thread may still be running in
    the env's state). ``self.transcript`` counts turns and calls for the reward."""

    expects_tools = True
    tool_methods: ClassVar[dict[str, str]] = {}
    """Tool name -> method name, collected from the ``@tool`` methods."""
    agent_kit: ClassVar[dict[str, str]] = {}
    """Modules the task offers a black-box agent that plays it (file name -> host path, standard
    library only), copied beside the agent in its job, so that its tools answer as this env's do."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found = {
            name: name
            for klass in reversed(cls.__mro__)
            for name, member in vars(klass).items()
            if getattr(member, "is_tool", False)
        }
        cls.tool_methods = found
        if "tools" not in vars(cls):
            cls.tools = [function_schema(getattr(cls, m), name) for name, m in found.items()]

    def __init__(self) -> None:
        self.transcript = Transcript()
        self.strays: list[threading.Thread] = []

    def tool_functions(self) -> dict[str, Callable]:
        return {name: getattr(self, method) for name, method in self.tool_methods.items()}

    def step(self, action: Action) -> StepAnswer:
        t = self.transcript
        t.turns += 1
        t.truncated = action.finish_reason == "length"
        if not action.tool_calls:
            return self.answer(action)
        messages, results = run_tools(
            action.tool_calls, self.tool_functions(), self.limits, self.deadline, self.strays
        )
        t.tool_calls += len(results)
        t.statuses += [r.status for r in results]
        self.tool_timed_out |= any(r.status == ToolStatus.TIMEOUT for r in results)
        return messages, self.tool_timed_out, results

    def answer(self, action: Action) -> StepAnswer:
        """A turn without tool calls: the final answer (unless cut at its token budget), done."""
        if action.finish_reason != "length":
            self.transcript.final_text = action.text
        return [], True, []

    def settle(self, timeout: float) -> bool:
        return settle_threads(self.strays, timeout)
