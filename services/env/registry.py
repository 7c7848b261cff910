"""The environments a replica runs: the built-ins (``calc``, ``guess``) and plugins given as
``module:Class``, either an ``Env`` subclass or a TRL-style class (``adapters.py``). A plugin
may replace a built-in of the same name, never another plugin. Built-ins that run the model's
code (``pyexec``) or an agent (``calc-harness``) in the sandbox are served on request, named in
``plugins`` like one (``ON_REQUEST``)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from relayrl.env.adapters import is_trl_style, trl_env
from relayrl.env.base import Env, EnvUnavailable
from relayrl.env.calc import CalcEnv
from relayrl.env.config import AgentEnvSpec, OpenEnvServer, VerifiersEnvSpec
from relayrl.env.guess import GuessEnv
from relayrl.env.harness import HarnessEnv, agent_env
from relayrl.env.openenv import openenv_env
from relayrl.env.tools import ToolEnv
from relayrl.env.verifiers import verifiers_env

BUILTINS: tuple[type[Env], ...] = (CalcEnv, GuessEnv)
ON_REQUEST = {
    "pyexec": "relayrl.env.pyexec:PyExecEnv",
    "calc-harness": "relayrl.env.harness:CalcHarnessEnv",
}
"""Built-ins served only when named in ``plugins``: they run the model's code, and a replica
starts (and probes) its sandbox only for envs that need one."""


class PluginError(RuntimeError):
    """A plugin could not be loaded (import failed, not an env class, bad attributes)."""


@dataclass(frozen=True)
class EnvSpec:
    """One env of the replica, as ListEnvs reports it."""

    name: str
    cls: type[Env]
    origin: str
    """``module:Class`` it came from."""
    from_plugin: bool

    @property
    def tools_json(self) -> str:
        return json.dumps(self.cls.tools)


def _checked(cls: type[Env], ref: str) -> type[Env]:
    """``cls`` when its class attributes make sense, else PluginError naming ``ref``."""
    if not isinstance(cls.name, str) or not cls.name or len(cls.name) > 128:
        raise PluginError(f"plugin {ref}: name must be a non-empty string of at most 128 characters")
    if not isinstance(cls.max_turns, int) or not 1 <= cls.max_turns <= 10_000:
        raise PluginError(
            f"plugin {ref}: max_turns must be a whole number in 1..10000, got {cls.max_turns!r}"
        )
    try:
        json.dumps(cls.tools)
    except (TypeError, ValueError) as e:
        raise PluginError(f"plugin {ref}: tools are not JSON: {e}") from None
    if not isinstance(cls.tools, list):
        raise PluginError(f"plugin {ref}: tools must be a list of function schemas")
    for flag in ("black_box", "needs_sandbox", "expects_tools"):
        if not isinstance(getattr(cls, flag), bool):
            raise PluginError(f"plugin {ref}: {flag} must be True or False, got {getattr(cls, flag)!r:.40}")
    return cls


def _imported(ref: str, what: str) -> object:
    """What ``module:Name`` names; PluginError starting with ``what`` when it does not load."""
    module, _, name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raises on import
        raise PluginError(f"{what}: cannot load: {type(e).__name__}: {e}") from e


def load_plugin(
    ref: str, reward_funcs: Sequence[str] = (), weights: Sequence[float] | None = None
) -> type[Env]:
    """Import ``module:Class``: an ``Env`` subclass, or a TRL environment class (wrapped, scored
    by its ``get_reward`` and ``reward_funcs``)."""
    obj = _imported(ref, f"plugin {ref}")
    if inspect.isclass(obj) and issubclass(obj, Env):
        return _checked(obj, ref)
    if is_trl_style(obj):
        try:
            return _checked(trl_env(obj, reward_funcs=reward_funcs, weights=weights), ref)
        except (
            TypeError,
            NameError,
            ImportError,
            AttributeError,
        ) as e:  # a hint or function that does not resolve
            raise PluginError(f"plugin {ref}: {type(e).__name__}: {e}") from e
    raise PluginError(f"plugin {ref}: not an Env subclass nor a TRL environment class (one with reset)")


def task_env(ref: str) -> type[ToolEnv]:
    """The task an ``env.agents`` entry plays: a built-in tool env's name (``calc``, ``pyexec``)
    or ``module:Class`` of a ``ToolEnv`` subclass; PluginError otherwise."""
    builtins = {c.name: c for c in BUILTINS}
    if ref in builtins:
        cls: object = builtins[ref]
    else:
        target = ON_REQUEST.get(ref, ref)
        if ":" not in target:
            known = ", ".join(sorted(c.name for c in BUILTINS if issubclass(c, ToolEnv)) + ["pyexec"])
            raise PluginError(f"task {ref!r:.80}: neither a built-in tool env ({known}) nor module:Class")
        cls = _imported(target, f"task {ref}")
    if not (inspect.isclass(cls) and issubclass(cls, ToolEnv)) or issubclass(cls, HarnessEnv):
        raise PluginError(f"task {ref!r:.80}: an agent plays a ToolEnv's episodes, not {cls!r:.80}")
    return cls


def build_registry(
    plugins: Sequence[str],
    reward_funcs: Sequence[str] = (),
    weights: Sequence[float] | None = None,
    openenv: Sequence[OpenEnvServer] = (),
    verifiers: Sequence[VerifiersEnvSpec] = (),
    agents: Sequence[AgentEnvSpec] = (),
) -> dict[str, EnvSpec]:
    """Built-ins, then plugins, then OpenEnv servers (``EnvConfig.openenv``), verifiers
    environments (``EnvConfig.verifiers``) and agents from folders (``EnvConfig.agents``), by name
    (TRL classes scored with ``reward_funcs``). Plugins may live in modules next to where the
    service was started (its working folder is searched last)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    specs = {c.name: EnvSpec(c.name, c, f"{c.__module__}:{c.__qualname__}", False) for c in BUILTINS}

    def add(cls: type[Env], origin: str, what: str) -> None:
        prev = specs.get(cls.name)
        if prev is not None and prev.from_plugin:
            raise PluginError(f"{what}: env {cls.name!r} is already served by {prev.origin}")
        specs[cls.name] = EnvSpec(cls.name, cls, origin, True)

    for ref in plugins:
        add(load_plugin(ref, reward_funcs, weights), ref, f"plugin {ref}")
    for server in openenv:
        try:
            cls = openenv_env(
                server.name, server.url, server.max_turns, server.description, server.connect_timeout_seconds
            )
        except EnvUnavailable as e:
            raise PluginError(f"openenv {server.name}: {e}") from None
        add(_checked(cls, server.url), server.url, f"openenv {server.name}")
    for vf in verifiers:
        try:
            cls = _checked(verifiers_env(vf), f"verifiers:{vf.taskset}")
        except ValueError as e:
            raise PluginError(f"verifiers {vf.name}: {e}") from None
        add(cls, f"verifiers:{vf.taskset}", f"verifiers {vf.name}")
    for agent in agents:
        try:
            cls = _checked(agent_env(agent, task_env(agent.task)), f"agent:{agent.folder}")
        except (ValueError, TypeError, PluginError) as e:
            raise PluginError(f"agents {agent.name}: {e}") from None
        add(cls, f"agent:{agent.folder}", f"agents {agent.name}")
    return dict(sorted(specs.items()))
