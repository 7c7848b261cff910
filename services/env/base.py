"""What an environment plugin implements: plain Python, no gRPC, no asyncio.

An env replica makes one ``Env`` object per session (``cls()``, no arguments) and calls it from a
worker thread, one call at a time:

* ``reset(task, seed) -> messages``: the dialogue's first messages (system and user), as chat
  dicts ``{"role": ..., "content": ...}``. ``task`` is the data row (a JSON object). Raise
  ``TaskError`` for a task this env refuses (the caller gets INVALID_ARGUMENT).
* ``step(action) -> (observations, done, tool_results)``: the model's turn in, the env's answer
  out: "tool" messages (``{"role": "tool", "content", "tool_call_id", "name"}``), then at most one
  "user" message; ``done`` ends the episode; one ``ToolResult`` per call of the action, in order.
* ``reward() -> Reward``: the episode's reward, components and outcome, asked once at Close.
* ``close()``: free what the session holds (always called once, even after a failure).

A black-box env (``black_box = True``, e.g. ``harness.py``) runs an agent of its own, which calls
the model through the gateway's OpenAI API: the service sets ``gateway`` (the episode's endpoint
and key, from ResetRequest.gateway) on the instance before ``reset``, and the caller sends one
Step, in which the agent plays the whole episode.

A tool error the model caused is an observation (``ToolEnv`` in ``tools.py`` does this for
method tools). Anything ``reset``/``step``/``reward`` raise, other than ``TaskError``, is the
environment's own failure: the episode is redone (Outcome REDO, failure kind "env_crashed", or
an ``EnvUnavailable``'s own kind), never scored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, NamedTuple


class TaskError(ValueError):
    """The env refuses the task (no ground truth, a malformed prompt): the caller's data is at
    fault, so Reset fails INVALID_ARGUMENT and nothing is retried."""


class EnvUnavailable(RuntimeError):
    """What the env needs is down (its sandbox cannot start): neither the model's doing nor an
    observation. Raised from ``step`` (a tool may raise it: ``tools.py`` passes it on), it ends
    the episode, and Close answers REDO with failure kind ``kind``: never a reward."""

    def __init__(self, message: str, kind: str = "env_unavailable"):
        super().__init__(message)
        self.kind = kind


class ToolStatus(StrEnum):
    """What became of one tool call (relayrl.env.v1.ToolStatus)."""

    OK = "ok"
    INVALID_ARGS = "invalid_args"
    UNKNOWN_TOOL = "unknown_tool"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    OUTPUT_TRUNCATED = "output_truncated"
    PARSE_ERROR = "parse_error"


class Outcome(StrEnum):
    """Whether an episode is evidence about the policy (relayrl.env.v1.Outcome)."""

    OK = "ok"
    MASK = "mask"
    REDO = "redo"


@dataclass(frozen=True)
class ToolCall:
    """One call the generator read out of a completion."""

    id: str
    name: str
    arguments_json: str = "{}"
    """Arguments as JSON object text; for a call that did not parse, the raw text of the call."""
    parse: str = "ok"
    """"ok", or how it failed: "invalid_json", "unclosed_block", "missing_name",
    "invalid_arguments", "unspecified" (not parsed at all). Only "ok" calls may run."""

    def arguments(self) -> dict:
        """The arguments of an OK call; ValueError when they are not a JSON object."""
        try:
            args = json.loads(self.arguments_json or "{}")
        except (ValueError, RecursionError) as e:
            raise ValueError(f"arguments are not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(args).__name__}")
        return args


@dataclass(frozen=True)
class Action:
    """The model's turn."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"
    """"stop", "length" (cut at the token budget), "abort", or "" (not said)."""


@dataclass(frozen=True)
class ToolResult:
    tool_call_id: str
    name: str
    status: ToolStatus


class Reward(NamedTuple):
    """What Close answers. ``reward`` counts only when ``outcome`` is OK."""

    reward: float
    components: dict[str, float] = {}
    outcome: Outcome = Outcome.OK
    failure_kind: str = ""
    """For MASK and REDO: a short name of what failed ("verifier_failed")."""
    failure_reason: str = ""


@dataclass(frozen=True)
class GatewayEndpoint:
    """Where a black-box env's agent reaches the model: the gateway's OpenAI-compatible API for one
    episode (relayrl.env.v1.GatewayEndpoint; the service checks its bounds)."""

    base_url: str
    """e.g. "http://127.0.0.1:8000/v1": http or https, at most 512 characters."""
    api_key: str
    """Bearer key of the episode's gateway session (a secret: never logged)."""
    model: str
    """Model name to put in requests."""

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"GatewayEndpoint(base_url={self.base_url!r}, api_key='***', model={self.model!r})"


@dataclass(frozen=True)
class Limits:
    """Bounds the service sets on every env it makes (from its config)."""

    tool_timeout_seconds: float = 10.0
    max_tool_output_chars: int = 8192


StepAnswer = tuple[list[dict], bool, list[ToolResult]]


class Env:
    """Base of every environment. Subclasses set the class attributes and the four methods."""

    name: ClassVar[str] = ""
    """Name sessions are opened with (EnvInfo.name)."""
    description: ClassVar[str] = ""
    """One line on what the env is."""
    tools: ClassVar[list[dict]] = []
    """OpenAI-style function schemas offered to the model; empty for a text-only env."""
    expects_tools: ClassVar[bool] = False
    """True when episodes are expected to call tools (a run without calls raises an alarm)."""
    max_turns: ClassVar[int] = 8
    """Most assistant turns in an episode: the service ends it after that many steps."""
    needs_sandbox: ClassVar[bool] = False
    """True when the env runs the model's code: a replica serving it starts a sandbox
    (``relayrl.common.sandbox``) and hands it to each instance as ``sandbox``."""

    black_box: ClassVar[bool] = False
    """True when the env runs its own agent against the gateway (EnvInfo.black_box): a Reset must
    carry a gateway endpoint, and the caller sends one Step with an empty action."""

    limits: Limits = Limits()
    """Set by the service on each instance."""
    gateway: GatewayEndpoint | None = None
    """The episode's gateway endpoint, set by the service before ``reset`` when the Reset carries
    one (always, for a black-box env); else None."""
    sandbox: Any = None
    """The replica's ``Sandbox``, set by the service on envs that need one (else None)."""
    deadline: float | None = None
    """``time.monotonic()`` by which the current step must be answered; set before each step."""
    tool_timed_out: bool = False
    """Set when a tool call ran past its limit: the episode ended without the model seeing the
    answer, so it says nothing about the policy and Close masks it (never a reward)."""

    @classmethod
    def prepare(cls, sandbox: Any) -> None:
        """Once per replica, before it serves: what every session will need ready (a harness
        env installs its agent's requirements). ``sandbox`` is the replica's (None when it runs
        none). An exception stops the replica from starting, with its message. Default: nothing."""

    def reset(self, task: dict, seed: int) -> list[dict]:
        raise NotImplementedError

    def step(self, action: Action) -> StepAnswer:
        raise NotImplementedError

    def reward(self) -> Reward:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the session holds (processes, files). Default: nothing."""

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for work the env left running (a tool past its time
        limit); True once none is left. Called before ``reward``: a False episode is masked."""
        return True


@dataclass
class Transcript:
    """What a tool env remembers of its episode (for its reward)."""

    turns: int = 0
    tool_calls: int = 0
    final_text: str | None = None
    """The text of the turn that ended the episode without tool calls; None if none did."""
    truncated: bool = False
    """The last turn stopped at its token budget (finish reason "length")."""
    statuses: list[ToolStatus] = field(default_factory=list)


def prompt_messages(task: dict) -> list[dict]:
    """The row's ``prompt`` as chat messages: a list of ``{"role", "content"}`` or a string (one
    user message). TaskError when it is missing or malformed.

    >>> prompt_messages({"prompt": "hi"})
    [{'role': 'user', 'content': 'hi'}]
    """
    prompt = task.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise TaskError("task has no prompt (a non-empty list of chat messages, or a string)")
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise TaskError(f"prompt[{i}] is not a chat message with a string content")
        if m.get("role") not in ("system", "user", "assistant"):
            raise TaskError(f"prompt[{i}]: role must be system, user or assistant, got {m.get('role')!r:.40}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def ground_truth(task: dict) -> object:
    """``task["reward_model"]["ground_truth"]`` (the verl row layout), or TaskError."""
    rm = task.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
        raise TaskError("task has no reward_model.ground_truth")
    return rm["ground_truth"]
