"""Framework agents in the sandbox: a harness env's ``agent_folder`` (``agent.py``, its modules and
``requirements.txt``), whose requirements each replica installs once for the sandbox's interpreter
(``common.sandbox.packages``) and mounts read-only in every job.

What is checked: an install is built once and reused (read-only, world-readable, one folder per
requirements text); requirements that do not install are a ``PackagesError`` with pip's reason,
raised by the replica's ``prepare`` (it does not start) and a REDO, never a reward, if an episode
meets it; an agent imports its installed packages in the sandbox and cannot write them; and a
LangChain agent (``examples/agents/langchain_calc``, ``langchain-openai`` and its ~40 wheels
installed into the sandbox's Python) plays calc in the sandbox through a real gateway, its only
network: one segment, no history break, exactly the sampled tokens, calc's reward.

No test reaches past loopback: wheels come from a local folder (``--no-index --find-links``), made
here or fetched by ``scripts/test.sh``, the test command, beforehand.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
import zipfile
from pathlib import Path

import pytest
from relayrl.common.sandbox import PackagesError, Sandbox
from relayrl.common.sandbox.packages import install, interpreter_version
from relayrl.env.base import Action, EnvUnavailable, GatewayEndpoint, Outcome
from relayrl.env.calc import CalcEnv
from relayrl.env.harness import CalcHarnessEnv

from tests.kit.agent_wheels import agent_wheels, offline
from tests.kit.openai_fake import FakeOpenAI, answer

ROOT = Path(__file__).resolve().parents[2]
LANGCHAIN_AGENT = ROOT / "examples" / "agents" / "langchain_calc"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def make_wheel(
    folder: Path, name: str = "agentlib", version: str = "0.1", code: str = "VALUE = 42\n"
) -> Path:
    """A pure-Python wheel of one module, written by hand (no build, no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": code,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: relayrl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
        z.writestr(f"{dist}/RECORD", "".join(f"{p},,\n" for p in [*files, f"{dist}/RECORD"]))
    return path


@pytest.fixture
def reachable():
    """A folder the sandbox's users can reach (pytest's own are closed to other users)."""
    d = Path(tempfile.mkdtemp(prefix="relayrl-packages-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    for folder, _, _ in os.walk(d):
        os.chmod(folder, 0o755)
    shutil.rmtree(d)


@pytest.fixture(scope="module")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    box = Sandbox("full", workers=1)
    try:
        interpreter_version(box.python)
    except Exception as e:  # pragma: no cover - a machine without the sandbox's interpreter
        pytest.skip(f"no sandbox interpreter: {e}")
    yield box
    box.close()


def test_requirements_install_once_read_only_and_per_text(tmp_path, sandbox, reachable):
    wheels = tmp_path / "wheels"
    make_wheel(wheels)
    make_wheel(wheels, version="0.2", code="VALUE = 2\n")
    root = reachable / "packages"
    first = install(offline(wheels, "agentlib==0.1"), sandbox.python, root)
    assert (first / "agentlib" / "__init__.py").read_text() == "VALUE = 42\n"
    again = install(offline(wheels, "agentlib==0.1"), sandbox.python, root)
    assert again == first  # reused: pip is not run again (it would fail: the wheel is gone)
    (wheels / "agentlib-0.1-py3-none-any.whl").unlink()
    assert install(offline(wheels, "agentlib==0.1"), sandbox.python, root) == first
    other = install(offline(wheels, "agentlib==0.2"), sandbox.python, root)
    assert other != first and (other / "agentlib" / "__init__.py").read_text() == "VALUE = 2\n"
    for folder, _, files in os.walk(first):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o555
        for name in files:
            mode = stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)
            assert mode & 0o444 == 0o444 and not mode & 0o222, (name, oct(mode))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([first.name, other.name])
    if os.geteuid() == 0:  # jobs run as users of their own: a folder they cannot reach is refused
        with pytest.raises(PackagesError, match="closed to other users"):
            install(offline(wheels, "agentlib==0.2"), sandbox.python, tmp_path / "closed")


def test_requirements_that_do_not_install_say_why_and_stop_the_replica(tmp_path, sandbox, reachable):
    reqs = tmp_path / "requirements.txt"
    reqs.write_text(offline(tmp_path, "no-such-package==1.0"))
    with pytest.raises(PackagesError, match="no-such-package"):
        install(reqs.read_text(), sandbox.python, reachable / "packages")
    assert not [p for p in (reachable / "packages").iterdir() if p.is_dir()]  # nothing half-built kept

    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "agent.py").write_text("print('never runs')\n")
    shutil.copy(reqs, folder / "requirements.txt")
    cls = type("Broken", (CalcHarnessEnv,), {"name": "broken", "agent_folder": str(folder)})
    assert cls.agent_requirements == str(folder / "requirements.txt")
    box = Sandbox("full", workers=1, packages_dir=str(reachable / "packages"))
    try:
        with pytest.raises(PackagesError, match="no-such-package"):
            cls.prepare(box)  # the env service's build() calls it: the replica does not start
        env = cls()  # an episode that meets it anyway (prepare skipped): REDO, never a reward
        env.sandbox, env.gateway = box, GatewayEndpoint("http://127.0.0.1:9/v1", "k", "m")
        env.reset(
            {"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}, "data_source": "calc"}, 0
        )
        with pytest.raises(EnvUnavailable, match="no-such-package") as lost:
            env.step(Action(""))
        assert lost.value.kind == "agent_packages"
    finally:
        box.close()


AGENT = """
import json, os, sys
import agentlib
spec = json.load(sys.stdin)
where = os.path.dirname(agentlib.__file__)
try:
    open(os.path.join(where, "mine.py"), "w").write("x = 1")
    wrote = "wrote"
except OSError as e:
    wrote = type(e).__name__
print(json.dumps({"final": json.dumps({"value": agentlib.VALUE, "where": where, "wrote": wrote}),
                  "turns": 0, "tool_calls": 0, "truncated": False}))
"""


@needs_bwrap
def test_a_folder_agent_imports_its_packages_in_the_sandbox_and_cannot_write_them(
    tmp_path, sandbox, reachable
):
    make_wheel(tmp_path / "wheels")
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "agent.py").write_text(AGENT)
    (folder / "requirements.txt").write_text(offline(tmp_path / "wheels", "agentlib==0.1"))
    cls = type("Folder", (CalcHarnessEnv,), {"name": "folder", "agent_folder": str(folder)})
    box = Sandbox("full", workers=1, packages_dir=str(reachable / "packages"))
    try:
        cls.prepare(box)
        with FakeOpenAI([answer("unused")]) as fake:
            env = cls()
            env.sandbox, env.gateway = box, GatewayEndpoint(fake.url, "k", "m")
            env.reset(
                {"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}, "data_source": "calc"}, 0
            )
            env.step(Action(""))
    finally:
        box.close()
    assert env.failure is None, env.failure
    seen = json.loads(env.task.transcript.final_text)
    assert seen == {"value": 42, "where": "/opt/relayrl/packages/agentlib", "wrote": "OSError"}


@needs_bwrap
def test_a_langchain_agent_plays_calc_in_the_sandbox_through_the_gateway_token_for_token(tmp_path, sandbox):
    """The example's agent from the config alone (``env.agents``: task ``calc``, its folder, a
    requirements file of offline wheels): calc's calculator reaches the job from the task's kit;
    the model is asked exactly the prompt the white-box calc env renders (so a model warm-started
    on calc's episodes is warm-started on what LangChain sends)."""
    from relayrl.env.config import EnvConfig
    from relayrl.env.registry import build_registry

    from tests.kit.agent_stack import ANSWER, QUESTION, segments_are_the_sampled_tokens, stack

    wheels = agent_wheels(LANGCHAIN_AGENT / "requirements.txt")
    reqs = tmp_path / "offline.txt"
    reqs.write_text(offline(wheels) + (LANGCHAIN_AGENT / "requirements.txt").read_text())
    spec = {
        "name": "calc-langchain",
        "task": "calc",
        "folder": str(LANGCHAIN_AGENT),
        "requirements": str(reqs),
    }
    cls = build_registry([], agents=EnvConfig(agents=[spec]).agents)["calc-langchain"].cls
    assert set(cls.agent_files) == {"arith.py"} and cls.tools == CalcEnv.tools
    box = Sandbox("full", workers=1)  # the default folder: installed once, reused by later runs
    task = {"prompt": QUESTION, "reward_model": {"ground_truth": ANSWER}, "data_source": "calc"}

    async def play(budget: int):
        async with stack() as s:
            opened = await s.open("p/0", budget)
            base = f"http://127.0.0.1:{s.port}/v1"
            env = cls()
            env.sandbox, env.gateway = box, GatewayEndpoint(base, opened.session_key, opened.model)
            env.reset(task, 0)
            await asyncio.to_thread(env.step, Action(""))
            return env, env.reward(), await s.close(opened.session_key), s.engine

    try:
        cls.prepare(box)  # as the env service does before serving: installs the ~40 wheels once
        env, reward, closed, engine = asyncio.run(play(4096))
        # The episode's token budget spent after its first call: the gateway refuses the second
        # (400, context_length_exceeded), and the agent ends the episode cut: the policy's doing,
        # scored 0 by calc, never masked as the agent's failure.
        cut_env, cut_reward, cut_closed, _ = asyncio.run(play(8))
    finally:
        box.close()
    assert cut_env.failure is None and cut_env.task.transcript.truncated, cut_env.failure
    assert cut_reward.outcome == Outcome.OK and cut_reward.reward == 0.0 and cut_closed.calls == 1
    assert env.failure is None, env.failure
    assert reward.outcome == Outcome.OK and reward.reward == 1.0, reward
    assert env.task.transcript.tool_calls == 1 and env.task.transcript.turns == 2
    assert closed.calls == 2 and closed.history_breaks == 0 and len(closed.segments) == 1
    segments_are_the_sampled_tokens(closed, engine)
    white_box = CalcEnv().reset(task, 0)
    assert engine.sampled[0].prompt_ids == engine.chat_codec().render(white_box, CalcEnv.tools)


def test_an_agent_entry_names_what_is_wrong(tmp_path):
    from relayrl.env.config import EnvConfig
    from relayrl.env.registry import PluginError, build_registry

    def build(**kw):
        spec = {"name": "a", "task": "calc", "folder": str(LANGCHAIN_AGENT), **kw}
        return build_registry([], agents=EnvConfig(agents=[spec]).agents)

    with pytest.raises(ValueError, match="folder: '/nonexistent/agent' is not a folder"):
        build(folder="/nonexistent/agent")
    with pytest.raises(PluginError, match=r"agents a: .*holds no agent.py"):
        build(folder=str(tmp_path))
    with pytest.raises(PluginError, match="neither a built-in tool env"):
        build(task="nosuch")
    with pytest.raises(PluginError, match="not <class 'relayrl.env.guess.GuessEnv'>"):
        build(task="guess")
    with pytest.raises(PluginError, match="not <class 'relayrl.env.harness.CalcHarnessEnv'>"):
        build(task="calc-harness")
    with pytest.raises(ValueError, match="names must differ"):
        EnvConfig(agents=[{"name": "a", "task": "calc", "folder": str(LANGCHAIN_AGENT)}] * 2)
    cls = build(task="pyexec", max_turns=3, agent_seconds=30, memory_mb=512)["a"].cls
    assert cls.agent_turns == 3 and cls.agent_seconds == 30 and cls.agent_limits.memory_mb == 512
    assert cls.agent_requirements == str(LANGCHAIN_AGENT / "requirements.txt")
