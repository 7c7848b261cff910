"""Run a TRL-style environment class unchanged (TRL's ``environment_factory`` convention).

Such a class is made with no arguments, one object per episode. ``reset(**row)`` gets the data
row's fields as keyword arguments and may return a text, which is appended to the prompt's last
user message; every other public method (no leading underscore) is a tool, its schema read from
its type hints and Google-style docstring; ``get_reward()`` returns the episode's reward. A tool
that raises is answered "error: ..." and the episode goes on, as TRL does. A turn without tool
calls ends the episode.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

from relayrl.env.base import Action, Env, Reward, StepAnswer, ToolStatus, prompt_messages
from relayrl.env.tools import function_schema, run_tools, settle_threads

RESERVED = ("reset", "get_reward")
"""Public methods of a TRL-style class that are not tools."""


def is_trl_style(cls: object) -> bool:
    """A class with ``reset`` and ``get_reward`` that is not an ``Env``."""
    return (
        inspect.isclass(cls)
        and not issubclass(cls, Env)
        and all(callable(getattr(cls, m, None)) for m in RESERVED)
    )


class TrlEnv(Env):
    """An ``Env`` around one object of ``inner_class`` (set by ``trl_env``)."""

    inner_class: ClassVar[type] = object
    tool_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.inner: Any = self.inner_class()
        self.strays: list = []
        self.tool_calls = 0

    def reset(self, task: dict, seed: int) -> list[dict]:
        messages = prompt_messages(task)
        extra = self.inner.reset(**task)
        if isinstance(extra, str) and extra:
            if messages[-1]["role"] == "user":
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + extra}
            else:
                messages.append({"role": "user", "content": extra})
        return messages

    def step(self, action: Action) -> StepAnswer:
        if not action.tool_calls:
            return [], True, []
        functions = {name: getattr(self.inner, name) for name in self.tool_names}
        messages, results = run_tools(action.tool_calls, functions, self.limits, self.deadline, self.strays)
        self.tool_calls += len(results)
        self.tool_timed_out |= any(r.status == ToolStatus.TIMEOUT for r in results)
        return messages, self.tool_timed_out, results

    def reward(self) -> Reward:
        value = self.inner.get_reward()
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise TypeError(f"get_reward() must return a finite number, got {value!r:.60}")
        return Reward(float(value), {"tool_calls": float(self.tool_calls)})

    def settle(self, timeout: float) -> bool:
        return settle_threads(self.strays, timeout)


def trl_env(cls: type, name: str | None = None) -> type[Env]:
    """An ``Env`` class that runs TRL-style ``cls``; its name is ``cls.name`` if set, else the
    class name in lower case. TypeError when ``cls`` is not TRL-style."""
    if not is_trl_style(cls):
        raise TypeError(f"{cls!r} is not a TRL-style environment class (needs reset and get_reward)")
    tools = sorted(
        n
        for n, m in inspect.getmembers(cls, lambda m: inspect.isfunction(m) or inspect.ismethod(m))
        if not n.startswith("_") and n not in RESERVED
    )
    doc = inspect.getdoc(cls) or ""
    attrs = {
        "inner_class": cls,
        "tool_names": tuple(tools),
        "name": name or getattr(cls, "name", None) or cls.__name__.lower(),
        "description": getattr(cls, "description", None) or (doc.splitlines()[0] if doc else ""),
        "tools": [function_schema(getattr(cls, n), n) for n in tools],
        "expects_tools": bool(tools),
        "max_turns": int(getattr(cls, "max_turns", 8)),
    }
    return type(f"Trl{cls.__name__}", (TrlEnv,), attrs)
