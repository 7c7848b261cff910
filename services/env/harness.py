"""Harness envs: a black-box agent plays the episode in the sandbox, calling the model through the
gateway's OpenAI API (design §3d); built-in ``calc-harness`` (served on request, like ``pyexec``).

Flow. The coordinator opens a gateway session per episode and passes it in ResetRequest.gateway
(``Env.gateway``). ``reset`` is the task env's (``task_env``): its first messages and tools are
kept, and its reward scores the agent's final answer. The coordinator then sends one Step with an
empty action, in which the agent runs to its end in the replica's sandbox:

* the job's main program is ``agents/bootstrap.py``; beside it in /tmp: the agent program
  (``agent_program``, as ``agent.py``), ``relay.py`` and ``agent_files``;
* stdin: ``{"messages", "tools", "max_turns": agent_turns}`` (default: the task env's);
  environment: ``OPENAI_BASE_URL`` (http://127.0.0.1:8000 plus the path of the gateway's
  base_url), ``OPENAI_API_KEY``, ``OPENAI_MODEL``;
* network: the job's network namespace has only its own loopback. The bootstrap serves
  127.0.0.1:8000 there and pipes it to a Unix socket bind-mounted in, which the host end
  (``forward.GatewayForwarder``, made for this step, closed after it) pipes to the gateway. So
  the gateway is all the agent can reach. Tier ``rlimits-only`` has no namespaces to build this in:
  there the agent runs as a plain process, reaches the host's network anyway, and is pointed at
  the gateway's own base_url (no forwarder on either side); that tier is for trusted agents only.
  An https gateway is reached through the forwarders as https://127.0.0.1:8000, so its certificate
  must name 127.0.0.1: run the gateway on plain http inside the cluster.
* the agent prints one JSON line, ``{"final", "turns", "tool_calls", "truncated"}``.

Outcomes, by who is at fault (never a reward of 0 for a failure that is not the policy's):
the report read -> the task env's transcript is set from it and its ``reward`` is the episode's;
the sandbox (or the way to the gateway) cannot start -> ``EnvUnavailable``, Close answers REDO;
the agent ran past its time -> MASK "agent_timeout"; the agent exited non-zero or printed no
report -> MASK "agent_failed" with the end of its stderr. The agent's time is ``agent_seconds``,
cut to the step's own deadline (raise ``env.step_timeout_seconds`` and the caller's deadline above
it, else every episode is masked).

Your own harness: subclass ``HarnessEnv`` in a module of yours and name it in ``env.plugins``::

    class MyHarness(HarnessEnv):
        name = "my-harness"
        task_env = MyTaskEnv                  # a ToolEnv: its reset and reward; tools offered
        agent_program = "/opt/agents/my_agent.py"   # run under the sandbox's python3, stdlib only
        agent_files = {"helpers.py": "/opt/agents/helpers.py"}
        agent_seconds = 300.0

The agent is a Python program: it reads stdin and the OPENAI_* variables as above and prints the
report line (``agents/calc_agent.py`` is a model of one). It runs under ``python3 -I -S`` with the
standard library, what it brings in ``agent_files`` (imported from /tmp), and its own packages:
an agent written with a framework sets ``agent_folder`` (``agent.py``, its modules and a
``requirements.txt``, e.g. ``langchain-openai``), whose requirements each replica installs once,
before serving, for the sandbox's interpreter (``Sandbox.packages``: wheels only, into a shared
cache) and mounts read-only at ``PACKAGES`` in every job::

    class MyFrameworkHarness(HarnessEnv):
        name = "my-framework-harness"
        task_env = MyTaskEnv
        agent_folder = "/opt/agents/my_langchain_agent"   # agent.py, requirements.txt, ...

The agent's network is still the gateway alone: its client (the OpenAI SDK under LangChain,
pydantic-ai, the Agents SDK) needs only ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and the model.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from relayrl.common.sandbox import PackagesError, RunResult, SandboxLimits, SandboxUnavailable, Verdict
from relayrl.env.base import Action, Env, EnvUnavailable, Outcome, Reward, StepAnswer, TaskError
from relayrl.env.calc import CalcEnv
from relayrl.env.config import AgentEnvSpec, resolved
from relayrl.env.forward import GatewayForwarder
from relayrl.env.tools import ToolEnv, cut

logger = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
AGENTS = HERE / "agents"
SANDBOX_SOCKET = "/run/relayrl/gateway.sock"
"""Where the host's forwarder socket is bind-mounted in the job."""
SANDBOX_URL = "127.0.0.1:8000"
"""Where the bootstrap serves the gateway inside the job (``agents/bootstrap.py``)."""
RESERVED_FILES = ("main.py", "agent.py", "relay.py")
MAX_REASON_CHARS = 600
"""The end of the agent's stderr kept in a failure reason."""
MAX_FINAL_CHARS = 256 << 10
MAX_FOLDER_FILES = 64
PACKAGES = "/opt/relayrl/packages"
"""Where the agent's installed requirements are mounted in the job (read-only)."""
START_SECONDS = 1.0
"""Time kept back from the step's deadline for starting and ending the job."""


def _tail(text: str, limit: int = MAX_REASON_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else f"...{text[-limit:]}"


def _source(path: str) -> str:
    """A file the job gets, read at each run (a few KiB): an edited agent is picked up."""
    return Path(path).read_text()


def read_report(stdout: str) -> dict | None:
    """The agent's report: the last line of ``stdout`` as ``{"final": str | None, "turns": int,
    "tool_calls": int, "truncated": bool}``; None when it is not one.

    >>> read_report('log\\n{"final": "42", "turns": 2, "tool_calls": 1, "truncated": false}\\n')
    {'final': '42', 'turns': 2, 'tool_calls': 1, 'truncated': False}
    >>> read_report('{"final": 42}') is None
    True
    """
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if not isinstance(report, dict):
        return None
    final, turns, calls, truncated = (report.get(k) for k in ("final", "turns", "tool_calls", "truncated"))
    counts_ok = all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 31 for n in (turns, calls)
    )
    if (final is not None and not isinstance(final, str)) or not counts_ok or not isinstance(truncated, bool):
        return None
    return {"final": final, "turns": turns, "tool_calls": calls, "truncated": truncated}


class HarnessEnv(Env):
    """Base of harness envs: set ``name``, ``task_env`` and ``agent_program`` (see the module)."""

    black_box = True
    needs_sandbox = True
    max_turns = 1
    """One Step: the agent plays the whole episode in it."""

    task_env: ClassVar[type[ToolEnv] | None] = None
    """The env whose ``reset`` gives the first messages (its ``tools`` are offered to the agent) and
    whose ``reward`` scores the agent's final answer, from its ``transcript``."""
    agent_program: ClassVar[str] = ""
    """Host path of the agent program, copied into the job's /tmp as ``agent.py``."""
    agent_files: ClassVar[dict[str, str]] = {}
    """More files for the job's /tmp: file name -> host path (not main.py, agent.py, relay.py)."""
    agent_requirements: ClassVar[str] = ""
    """Host path of the agent's requirements file (pip's format): installed once per replica
    host for the sandbox's interpreter (``Sandbox.packages``, wheels only, at the replica's start)
    and mounted read-only at ``PACKAGES`` in each job, on the agent's ``sys.path``."""
    agent_folder: ClassVar[str] = ""
    """A folder holding the agent: ``agent.py``, the modules beside it (``*.py``, at most
    ``MAX_FOLDER_FILES``) and ``requirements.txt``; sets ``agent_program``, ``agent_files`` (the
    folder's modules, and the task env's ``agent_kit``) and ``agent_requirements`` where the class
    leaves them unset."""
    agent_turns: ClassVar[int | None] = None
    """Most model calls the agent may make (``max_turns`` of its stdin); None: the task env's
    ``max_turns``, as many as the white-box episode has."""
    agent_seconds: ClassVar[float] = 240.0
    """Wall-clock limit of the agent's run (cut to the step's deadline); past it: MASK."""
    agent_limits: ClassVar[SandboxLimits] = SandboxLimits(
        wall_seconds=240.0, cpu_seconds=240.0, memory_mb=1024, processes=64, output_bytes=1 << 20
    )
    """The job's limits but the wall clock: memory and processes (threads count) per process, and a
    CPU time that waiting on the model does not use up."""

    _packages: ClassVar[dict[str, str]] = {}
    """Requirements text -> the installed folder (``prepare``), per replica process."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "agent_folder" in vars(cls) and cls.agent_folder:
            _from_folder(cls)
        task = cls.task_env
        if task is None:
            return
        if not (isinstance(task, type) and issubclass(task, ToolEnv)):
            raise TypeError(f"{cls.__name__}.task_env must be a ToolEnv subclass, got {task!r:.80}")
        if not Path(cls.agent_program).is_file():
            raise ValueError(f"{cls.__name__}.agent_program {cls.agent_program!r:.200} is not a file")
        for name, path in cls.agent_files.items():
            if name in RESERVED_FILES or not Path(path).is_file():
                raise ValueError(f"{cls.__name__}.agent_files[{name!r:.80}]: a reserved name, or not a file")
        if cls.agent_requirements and not Path(cls.agent_requirements).is_file():
            raise ValueError(
                f"{cls.__name__}.agent_requirements {cls.agent_requirements!r:.200} is not a file"
            )
        turns = task.max_turns if cls.agent_turns is None else cls.agent_turns
        if not 0 < cls.agent_seconds <= 600 or not 1 <= turns <= 1000:
            raise ValueError(f"{cls.__name__}: agent_seconds must be in (0, 600], agent_turns in 1..1000")
        if "tools" not in vars(cls):
            cls.tools = task.tools
        if "expects_tools" not in vars(cls):
            cls.expects_tools = task.expects_tools

    @classmethod
    def prepare(cls, sandbox: Any) -> None:
        """Install the agent's requirements (once per host and requirements file; minutes the first
        time, then instant), so that no episode waits for it."""
        if cls.agent_requirements and sandbox is not None:
            cls._site(sandbox)

    @classmethod
    def _site(cls, sandbox: Any) -> str:
        """The folder with the agent's requirements installed (``PackagesError`` if they do not
        install)."""
        text = Path(cls.agent_requirements).read_text()
        if text not in HarnessEnv._packages:
            logger.info("%s: installing the agent's requirements (%s)", cls.name, cls.agent_requirements)
            HarnessEnv._packages[text] = sandbox.packages(text)
        return HarnessEnv._packages[text]

    def __init__(self) -> None:
        self.task: ToolEnv | None = None
        self.first_messages: list[dict] = []
        self.ran = False
        self.failure: tuple[str, str] | None = None
        """(failure kind, reason) when the agent's run is no evidence: Close masks."""
        self.forwarder: GatewayForwarder | None = None

    def check_reset(self) -> None:
        """What every Reset of a harness env needs: the replica's sandbox, and a gateway."""
        if self.sandbox is None:
            raise EnvUnavailable(f"{self.name}: this replica runs no sandbox", "sandbox_unavailable")
        if self.gateway is None:
            raise TaskError(f"{self.name} runs a black-box agent: the Reset must carry a gateway")

    def reset(self, task: dict, seed: int) -> list[dict]:
        if self.task_env is None:
            raise TypeError(f"{type(self).__name__} names no task_env")
        self.check_reset()
        self.task = self.task_env()
        self.task.limits = self.limits
        self.first_messages = self.task.reset(task, seed)
        return self.first_messages

    def step(self, action: Action) -> StepAnswer:
        if self.ran:
            raise RuntimeError(f"{self.name}: the agent has run already (one step per episode)")
        self.ran = True
        wall = self.agent_seconds
        if self.deadline is not None:
            wall = min(wall, self.deadline - time.monotonic() - START_SECONDS)
        if wall < START_SECONDS:
            self.failure = ("agent_timeout", f"the step left the agent {wall:.3g}s to run")
            return [], True, []
        limits = self.agent_limits.model_copy(update={"wall_seconds": wall})
        try:
            result = self._run(limits)
        finally:
            self.close()
        self._judge(result, wall)
        return [], True, []

    def reward(self) -> Reward:
        if self.failure is not None:
            return Reward(0.0, {}, Outcome.MASK, *self.failure)
        if not self.ran or self.task is None:
            return Reward(0.0, {}, Outcome.MASK, "agent_not_run", "the episode closed before its step")
        return self.task.reward()

    def close(self) -> None:
        forwarder, self.forwarder = self.forwarder, None
        if forwarder is not None:
            forwarder.close()

    # ---- inside ------------------------------------------------------------------------------

    def agent_input(self) -> dict:
        """The agent's stdin (JSON): the task env's first messages and tools, its turns."""
        turns = self.task_env.max_turns if self.agent_turns is None else self.agent_turns
        return {"messages": self.first_messages, "tools": self.task_env.tools, "max_turns": turns}

    def _run(self, limits: SandboxLimits) -> RunResult:
        gw = self.gateway
        spec = self.agent_input()
        files = {
            "agent.py": _source(self.agent_program),
            "relay.py": _source(str(AGENTS / "relay.py")),
            **{name: _source(path) for name, path in self.agent_files.items()},
        }
        env = {"OPENAI_API_KEY": gw.api_key, "OPENAI_MODEL": gw.model, "OPENAI_BASE_URL": gw.base_url}
        binds = {}
        if self.agent_requirements:
            try:
                site = self._site(self.sandbox)
            except PackagesError as e:  # the replica's install, not the policy: REDO elsewhere
                raise EnvUnavailable(f"the agent's requirements: {e}", "agent_packages") from None
            inside = PACKAGES if self.sandbox.tier == "full" else site
            if self.sandbox.tier == "full":
                binds[site] = PACKAGES
            env["RELAYRL_AGENT_PACKAGES"] = inside
        if self.sandbox.tier == "full":
            try:
                self.forwarder = GatewayForwarder(gw.base_url)
            except (OSError, ValueError) as e:
                raise EnvUnavailable(
                    f"cannot forward to the gateway {gw.base_url!r:.200}: {e}", "gateway_unavailable"
                ) from None
            binds[self.forwarder.path] = SANDBOX_SOCKET
            parts = urlsplit(gw.base_url)
            env["OPENAI_BASE_URL"] = urlunsplit((parts.scheme, SANDBOX_URL, parts.path, parts.query, ""))
            env["RELAYRL_GATEWAY_SOCKET"] = SANDBOX_SOCKET
        bootstrap = _source(str(AGENTS / "bootstrap.py"))
        try:
            return self.sandbox.run_sync(
                bootstrap, json.dumps(spec), limits, files, binds=binds, env=env, deadline=self.deadline
            )
        except SandboxUnavailable as e:
            raise EnvUnavailable(f"the sandbox cannot run the agent: {e}", "sandbox_unavailable") from None

    def _judge(self, r: RunResult, wall: float) -> None:
        """The task env's transcript from the agent's report, or ``failure``."""
        report = self._report(r, wall)
        if report is not None:
            self.take(report)

    def _report(self, r: RunResult, wall: float) -> dict | None:
        """The agent's report (``read_report``); None, ``failure`` set, when there is none."""
        if r.verdict is Verdict.TIMEOUT:
            cpu = self.agent_limits.cpu_seconds
            why = f"the agent ran past its time limit ({wall:.3g}s wall, {cpu:g}s CPU)"
            self.failure = ("agent_timeout", f"{why}: {_tail(r.stderr)}" if r.stderr.strip() else why)
            return None
        report = read_report(r.stdout) if r.verdict is Verdict.OK and r.exit_code == 0 else None
        if report is None:
            how = f"exit status {r.exit_code}" if r.exit_code is not None else f"signal {r.signal}"
            what = (
                "printed no report"
                if r.verdict is Verdict.OK and r.exit_code == 0
                else f"ended {r.verdict} ({how})"
            )
            self.failure = ("agent_failed", f"the agent {what}: {_tail(r.stderr) or _tail(r.stdout)}")
        return report

    def take(self, report: dict) -> None:
        """What the report says goes into the task env's transcript, which its reward reads."""
        t = self.task.transcript
        t.turns, t.tool_calls, t.truncated = report["turns"], report["tool_calls"], report["truncated"]
        final = report["final"]
        t.final_text = None if final is None or report["truncated"] else cut(final, MAX_FINAL_CHARS)


def _from_folder(cls: type[HarnessEnv]) -> None:
    """Set ``cls``'s agent program, files and requirements from its ``agent_folder``."""
    folder = Path(cls.agent_folder)
    if not (folder / "agent.py").is_file():
        raise ValueError(f"{cls.__name__}.agent_folder {cls.agent_folder!r:.200} holds no agent.py")
    modules = sorted(p for p in folder.glob("*.py") if p.name != "agent.py")
    if len(modules) > MAX_FOLDER_FILES:
        raise ValueError(f"{cls.__name__}.agent_folder: at most {MAX_FOLDER_FILES} modules beside agent.py")
    if "agent_program" not in vars(cls):
        cls.agent_program = str(folder / "agent.py")
    if "agent_files" not in vars(cls):
        kit = cls.task_env.agent_kit if cls.task_env is not None else {}
        cls.agent_files = {**kit, **{p.name: str(p) for p in modules}}
    if "agent_requirements" not in vars(cls) and (folder / "requirements.txt").is_file():
        cls.agent_requirements = str(folder / "requirements.txt")


class CalcHarnessEnv(HarnessEnv):
    name = "calc-harness"
    description = (
        "calc played by a scripted agent in the sandbox through the gateway's OpenAI API; "
        "reward 1 for the right final number."
    )
    task_env = CalcEnv
    agent_program = str(AGENTS / "calc_agent.py")
    agent_files = dict(CalcEnv.agent_kit)


def agent_env(spec: AgentEnvSpec, task: type[ToolEnv]) -> type[HarnessEnv]:
    """The env class of one ``env.agents`` entry: ``spec``'s agent folder playing ``task``'s
    episodes (relative paths against the working folder; ``ValueError`` names what is wrong)."""
    folder = resolved(spec.folder, "folder", Path.cwd())
    attrs: dict[str, Any] = {
        "name": spec.name,
        "description": f"{task.name} played by the agent in {folder} (sandboxed, through the gateway)",
        "__module__": __name__,
        "task_env": task,
        "agent_folder": folder,
        "agent_turns": spec.max_turns,
        "agent_seconds": spec.agent_seconds,
        "agent_limits": SandboxLimits(
            **{
                **HarnessEnv.agent_limits.model_dump(),
                "cpu_seconds": spec.agent_seconds,
                "memory_mb": spec.memory_mb,
            }
        ),
    }
    if spec.requirements:
        attrs["agent_requirements"] = resolved(spec.requirements, "requirements", Path.cwd())
    return type(f"Agent_{spec.name}", (HarnessEnv,), attrs)
