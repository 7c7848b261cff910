"""Run a TRL environment class unchanged, scored as TRL scores it (``GRPOTrainer``'s
``environment_factory`` and ``reward_funcs``, trl >= 1.9).

Such a class is made with no arguments, one object per episode. ``reset(**row)`` gets the data
row's fields as keyword arguments and may return a text, which is appended to the prompt's last
user message; every other public method (no leading underscore, not ``get_reward``) is a tool, its
schema read from its type hints and Google-style docstring. A tool that raises is answered
"error: ..." and the episode goes on, as TRL does. A turn without tool calls ends the episode.

The reward, as TRL computes it: the class's own ``get_reward()`` where it has one (weight 1), plus
the reward functions the env config names (``env.reward_funcs``, weighted by ``reward_weights``),
each called as TRL calls them, on a batch of one: ``f(environments=[env], prompts=[messages],
completions=[messages the episode added], **{column: [value]})`` for the row's other columns,
returning a list of one float, or of None where it does not apply. An episode no function
applies to is masked (``no_reward``), never scored 0.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from relayrl.env.base import Action, Env, Outcome, Reward, StepAnswer, ToolStatus, prompt_messages
from relayrl.env.tools import function_schema, run_tools, settle_threads

RESERVED = ("reset", "get_reward")
"""Public methods of a TRL class that are not tools."""


def is_trl_style(cls: object) -> bool:
    """A class with ``reset`` that is not an ``Env`` (TRL's ``environment_factory`` protocol)."""
    return inspect.isclass(cls) and not issubclass(cls, Env) and callable(getattr(cls, "reset", None))


def load_function(ref: str) -> Callable:
    """``module:function``; TypeError when it does not name a callable."""
    module, _, name = ref.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{ref} is not a function")
    return fn


class TrlEnv(Env):
    """An ``Env`` around one object of ``inner_class`` (set by ``trl_env``)."""

    inner_class: ClassVar[type] = object
    tool_names: ClassVar[tuple[str, ...]] = ()
    reward_funcs: ClassVar[tuple[tuple[str, Callable | None, float], ...]] = ()
    """(name, function, weight) of each reward function, the class's ``get_reward`` first."""

    def __init__(self) -> None:
        self.inner: Any = self.inner_class()
        self.strays: list = []
        self.tool_calls = 0
        self.row: dict = {}
        self.prompt: list[dict] = []
        self.completion: list[dict] = []

    def reset(self, task: dict, seed: int) -> list[dict]:
        messages = prompt_messages(task)
        extra = self.inner.reset(**task)
        if isinstance(extra, str) and extra:
            if messages[-1]["role"] == "user":
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + extra}
            else:
                messages.append({"role": "user", "content": extra})
        self.row, self.prompt = task, messages
        return messages

    def step(self, action: Action) -> StepAnswer:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in action.tool_calls
        ]
        self.completion.append(
            {"role": "assistant", "content": action.text, **({"tool_calls": calls} if calls else {})}
        )
        if not action.tool_calls:
            return [], True, []
        functions = {name: getattr(self.inner, name) for name in self.tool_names}
        messages, results = run_tools(action.tool_calls, functions, self.limits, self.deadline, self.strays)
        self.completion.extend(messages)
        self.tool_calls += len(results)
        self.tool_timed_out |= any(r.status == ToolStatus.TIMEOUT for r in results)
        return messages, self.tool_timed_out, results

    def reward(self) -> Reward:
        columns = {k: [v] for k, v in self.row.items() if k != "prompt"}
        batch = {
            **columns,
            "prompts": [self.prompt],
            "completions": [self.completion],
            "environments": [self.inner],
        }
        total, parts = 0.0, {}
        for name, fn, weight in self.reward_funcs:
            value = _one(name, self.inner.get_reward() if fn is None else fn(**batch))
            if value is not None:
                parts[name] = value
                total += weight * value
        if not parts:
            names = ", ".join(n for n, _, _ in self.reward_funcs)
            return Reward(
                0.0, {}, Outcome.MASK, "no_reward", f"every reward function ({names}) answered None"
            )
        return Reward(total, {**parts, "tool_calls": float(self.tool_calls)})

    def settle(self, timeout: float) -> bool:
        return settle_threads(self.strays, timeout)


def _one(name: str, out: object) -> float | None:
    """The one value of a reward function's answer for a batch of one."""
    if isinstance(out, int | float) and not isinstance(out, bool):  # get_reward's plain number
        out = [out]
    if not isinstance(out, list | tuple) or len(out) != 1:
        raise TypeError(f"reward function {name} must return a list of one value, got {out!r:.60}")
    (value,) = out
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"reward function {name} must give a finite number or None, got {value!r:.60}")
    return float(value)


def trl_env(
    cls: type,
    name: str | None = None,
    reward_funcs: Sequence[str] = (),
    weights: Sequence[float] | None = None,
) -> type[Env]:
    """An ``Env`` class that runs TRL class ``cls``, scored by its ``get_reward`` (if any) and by
    ``reward_funcs`` (``module:function``) weighted by ``weights`` (default 1 each); its name is
    ``cls.name`` if set, else the class name in lower case. TypeError when ``cls`` is not a TRL
    class, a function does not load, or nothing would score it."""
    if not is_trl_style(cls):
        raise TypeError(f"{cls!r} is not a TRL environment class (needs reset)")
    if weights is not None and len(weights) != len(reward_funcs):
        raise TypeError(f"{len(weights)} reward weights for {len(reward_funcs)} reward functions")
    scorers: list[tuple[str, Callable | None, float]] = []  # None: the object's own get_reward
    if callable(getattr(cls, "get_reward", None)):
        scorers.append((cls.__name__, None, 1.0))
    for ref, weight in zip(reward_funcs, weights or [1.0] * len(reward_funcs), strict=True):
        scorers.append((ref.partition(":")[2], load_function(ref), float(weight)))
    if not scorers:
        raise TypeError(
            f"{cls.__name__} has no get_reward and the env config names no reward_funcs: nothing scores it"
        )
    tools = sorted(
        n
        for n, m in inspect.getmembers(cls, inspect.isfunction)
        if not n.startswith("_")
        and n not in RESERVED
        and not isinstance(inspect.getattr_static(cls, n), staticmethod)
    )
    doc = inspect.getdoc(cls) or ""
    attrs = {
        "inner_class": cls,
        "tool_names": tuple(tools),
        "reward_funcs": tuple(scorers),
        "name": name or getattr(cls, "name", None) or cls.__name__.lower(),
        "description": getattr(cls, "description", None) or (doc.splitlines()[0] if doc else ""),
        "tools": [function_schema(getattr(cls, n), n) for n in tools],
        "expects_tools": bool(tools),
        "max_turns": int(getattr(cls, "max_turns", 8)),
    }
    return type(f"Trl{cls.__name__}", (TrlEnv,), attrs)
