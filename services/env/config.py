"""Configuration of the environment service (sessions of multi-turn episodes)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from relayrl.common.config import StrictModel, plugin_refs
from relayrl.common.sandbox.limits import SandboxConfig
from relayrl.common.serving import ServeConfig


def checked_path(v: str, field: str) -> str:
    """A ``folder`` or ``requirements`` field: an absolute path is checked here (a folder, a
    file); a relative one is left as written, for the experiment's loader to resolve against the
    experiment file's folder (``relayrl.coordinator.derive``), a standalone replica against its
    working folder, and checked there (``resolved``)."""
    if not v or not Path(v).expanduser().is_absolute():
        return v
    return resolved(v, field, Path.cwd())


def resolved(v: str, field: str, base: Path) -> str:
    """``v`` made absolute under ``base`` and checked: ``folder`` a folder, any other field a file.

    >>> resolved("/", "folder", Path("/tmp"))
    '/'
    >>> resolved("nope.txt", "requirements", Path("/"))
    Traceback (most recent call last):
    ...
    ValueError: requirements: 'nope.txt' is not a file (/nope.txt)
    """
    if not v:
        return v
    path = (base / Path(v).expanduser()).resolve()
    if field.endswith("folder") and not path.is_dir():
        raise ValueError(f"{field}: {v!r:.200} is not a folder ({str(path):.200})")
    if not field.endswith("folder") and not path.is_file():
        raise ValueError(f"{field}: {v!r:.200} is not a file ({str(path):.200})")
    return str(path)


class OpenEnvServer(StrictModel):
    """An OpenEnv environment served by its own server (``openenv``: a container, an HF Space,
    ``uvicorn server.app:app``), played over its WebSocket protocol, one session per episode."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """The env's name here: what ``episodes.env`` names."""
    url: str = Field(..., pattern=r"^https?://[^\s]+$", max_length=512)
    """The server's base URL (its ``/schema`` and ``/ws`` hang off it), e.g.
    ``http://127.0.0.1:8000``."""
    max_turns: int = Field(8, ge=1, le=10_000)
    """Most assistant turns in an episode."""
    description: str = Field("", max_length=1000)
    """What the model's one tool (the env's Action) does; empty: the Action class's docstring."""
    connect_timeout_seconds: float = Field(30.0, gt=0, le=600)
    """Longest wait for the server's schema at start, a session's opening and its reset. A step
    waits at most ``tool_timeout_seconds``."""


class VerifiersEnvSpec(StrictModel):
    """A verifiers environment (Prime Intellect's ``verifiers`` 0.4, ``verifiers.v1``: the
    Environments Hub's), each rollout its own, run by verifiers in the replica's sandbox through
    the gateway (one session per rollout) and scored by its own rubric (``relayrl.env.verifiers``)."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """The env's name here: what ``episodes.env`` names (and ``data.generate.task:
    verifiers/<name>``)."""
    taskset: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")
    """The verifiers taskset id: a module whose ``__all__`` exports one ``Taskset`` subclass,
    installed by ``requirements`` (a Hub environment's package) or in ``folder``."""
    taskset_args: dict[str, Any] = Field(default_factory=dict)
    """More fields of the taskset's config (its ``TasksetConfig`` subclass), as verifiers'
    ``--env.taskset.*`` would set them."""
    harness: str = Field("", pattern=r"^([A-Za-z_][A-Za-z0-9_.]{0,127})?$")
    """A verifiers harness id; empty: the taskset's own, else relayrl's in-process chat harness
    (verifiers' default, ``bash``, installs uv from the internet at its first run)."""
    folder: str = Field("", max_length=4096)
    """A folder whose modules (``*.py``) each job gets beside the agent: the taskset's module
    when no package installs it; empty: none. Relative: to the experiment file (an embedded run),
    else to the env replica's working folder."""
    requirements: str = Field("", max_length=4096)
    """A requirements file (pip's format, its options too: ``--find-links`` for wheels offline)
    installed once per replica host for the sandbox's interpreter; it must hold ``verifiers`` and
    the taskset's own packages. Empty: ``verifiers==0.4.0`` alone."""
    max_turns: int = Field(8, ge=1, le=1000)
    """Most model calls in a rollout (verifiers' ``max_turns``)."""
    agent_seconds: float = Field(240.0, gt=0, le=600)
    """Wall-clock limit of a rollout (cut to the step's deadline); past it the episode is masked."""
    memory_mb: int = Field(2048, ge=256, le=65536)
    """Address space of each process of a rollout's job (verifiers, its interception server, its
    tool servers)."""

    @field_validator("folder", "requirements")
    @classmethod
    def _paths(cls, v: str, info: ValidationInfo) -> str:
        return checked_path(v, info.field_name)


class AgentEnvSpec(StrictModel):
    """A black-box agent from a folder (``agent.py``, its modules, ``requirements.txt``: an agent
    written with LangChain, pydantic-ai, the Agents SDK...) playing a task env's episodes in the
    replica's sandbox, the gateway its only network (``relayrl.env.harness.agent_env``): what a
    ``HarnessEnv`` subclass with ``agent_folder`` does, from the config alone."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
    """The env's name here: what ``episodes.env`` names."""
    task: str = Field(..., pattern=r"^[A-Za-z0-9_.:-]{1,256}$")
    """The env whose Reset gives the first messages and tools and whose reward scores the agent's
    final answer: a built-in tool env's name (``calc``, ``pyexec``) or a ``module:Class`` of a
    ``relayrl.env.tools.ToolEnv`` subclass. The job also gets the task's own modules for agents
    (calc: ``arith.py``, its calculator)."""
    folder: str = Field(..., min_length=1, max_length=4096)
    """The agent's folder: ``agent.py`` (run under the sandbox's python3 with the OPENAI_*
    variables set; it prints the harness's report line), its modules (``*.py``) and, optionally,
    ``requirements.txt``. Relative: to the experiment file (an embedded run), else to the env
    replica's working folder."""
    requirements: str = Field("", max_length=4096)
    """A requirements file used instead of the folder's (pip's format, its options too:
    ``--no-index --find-links`` for wheels offline); installed once per replica host for the
    sandbox's interpreter. Empty: the folder's ``requirements.txt``, if any."""
    max_turns: int | None = Field(None, ge=1, le=1000)
    """Most model calls the agent may make (``max_turns`` of its stdin); None: the task's."""
    agent_seconds: float = Field(240.0, gt=0, le=600)
    """Wall-clock limit of an episode's run (cut to the step's deadline); past it: masked."""
    memory_mb: int = Field(1024, ge=256, le=65536)
    """Address space of each process of the agent's job."""

    @field_validator("folder", "requirements")
    @classmethod
    def _paths(cls, v: str, info: ValidationInfo) -> str:
        return checked_path(v, info.field_name)


class EnvConfig(StrictModel):
    """One environment replica."""

    serve: ServeConfig = Field(default_factory=ServeConfig)
    """Where the replica listens."""
    plugins: list[str] = Field(default_factory=list)
    """User environments as ``module:Class``: an ``relayrl.env.base.Env`` subclass, or a TRL
    environment class as ``GRPOTrainer(environment_factory=...)`` takes it (public methods are
    tools, ``reset(**row)``; scored by its ``get_reward()`` and ``reward_funcs``)."""
    reward_funcs: list[str] = Field(default_factory=list)
    """TRL reward functions (``module:function``) scoring the TRL environment classes in
    ``plugins``, called as ``GRPOTrainer(reward_funcs=...)`` calls them: ``environments``,
    ``prompts``, ``completions`` and the row's other columns, a batch of one; None where one does
    not apply."""
    reward_weights: list[float] | None = None
    """Weights of ``reward_funcs`` (TRL's ``GRPOConfig.reward_weights``); None: 1 each. A class's
    own ``get_reward`` counts with weight 1."""
    openenv: list[OpenEnvServer] = Field(default_factory=list)
    """OpenEnv environments, each on its own server: the replica reads each one's Action schema at
    start (and refuses to start while one does not answer)."""
    verifiers: list[VerifiersEnvSpec] = Field(default_factory=list)
    """verifiers environments: the replica installs each one's requirements for its sandbox's
    interpreter at start (minutes the first time on a host, then reused)."""
    agents: list[AgentEnvSpec] = Field(default_factory=list)
    """Black-box agents from folders (a framework's agent), each playing a task env's episodes in
    the sandbox through the gateway; their requirements are installed at start, as verifiers'."""
    max_sessions: int = Field(1024, ge=1, le=1_000_000)
    """Most sessions open at once; a Reset past it is RESOURCE_EXHAUSTED (retry later or
    elsewhere)."""
    lease_seconds: float = Field(1800.0, gt=0, le=86400)
    """A session no call touches for this long is closed by the replica (its env freed); later
    calls on it are NOT_FOUND. Longer than the caller's longest turn (a Generate call under its
    deadline, ``services.deadline_seconds`` for the coordinator): the backstop for sessions a
    caller that died left open."""
    step_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    """Longest time env code may take in one Reset, Step or Close (and never past the caller's
    deadline). A Step past it ends the episode, which Close reports REDO ("env_timeout")."""
    tool_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    """Longest time one tool call may run; past it the call is answered TIMEOUT and the episode
    ends (its thread may still be running in the env)."""
    max_tool_output_chars: int = Field(8192, ge=64, le=1 << 20)
    """A tool's answer is cut to this many characters (status OUTPUT_TRUNCATED)."""
    threads: int = Field(64, ge=1, le=4096)
    """Threads running env code (reset, step, reward, close); tool calls run in threads of their
    own beside them."""
    closed_keep_seconds: float = Field(600.0, ge=0, le=86400)
    """How long a closed or expired session is remembered: a retried Close gets the same answer,
    a late call a NOT_FOUND that says why."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where envs that run the model's code (``needs_sandbox``, e.g. ``pyexec``) run it: isolation
    tier, default limits of a run, jobs at once. Started, and probed, only when such an env is
    served: a replica refuses to start when tier ``full`` finds isolation missing."""
    replica_id: str = Field("", max_length=256)
    """Id reported by ListEnvs; empty: ``<hostname>:<pid>``."""

    @field_validator("plugins")
    @classmethod
    def _plugin_refs(cls, v: list[str]) -> list[str]:
        return plugin_refs(v, "Class")

    @field_validator("reward_funcs")
    @classmethod
    def _function_refs(cls, v: list[str]) -> list[str]:
        return plugin_refs(v, "function")

    def path_fields(self) -> Iterator[tuple[str, StrictModel, str]]:
        """(dotted field, spec, attribute) of every agent's and verifiers environment's folder and
        requirements file: what the replica reads from its host's disk."""
        for kind in ("verifiers", "agents"):
            for i, spec in enumerate(getattr(self, kind)):
                for attr in ("folder", "requirements"):
                    yield f"env.{kind}.{i}.{attr}", spec, attr

    @model_validator(mode="after")
    def _weights(self) -> EnvConfig:
        names = [o.name for o in [*self.openenv, *self.verifiers, *self.agents]]
        if len(set(names)) != len(names):
            raise ValueError(f"openenv, verifiers, agents: names must differ, got {names}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs"
            )
        if self.reward_weights is not None and not all(math.isfinite(w) for w in self.reward_weights):
            raise ValueError("reward_weights: every weight must be a finite number")
        return self
