"""Harness envs (``relayrl.env.harness``): a black-box agent in the sandbox whose only network is
the gateway, reached through two forwarders (``relayrl.env.forward`` on the host,
``agents/bootstrap.py`` in the job).

What is checked: the host forwarder pipes bytes both ways to a loopback server (megabytes, half
closes, a bound on connections, everything closed after); the built-in calc agent, run in the real
sandbox through the real forwarders, plays calc against a fake OpenAI server and the reward is
calc's (and so through the env service: ListEnvs says black_box, Reset carries the gateway); inside
the sandbox nothing but the gateway answers (a host-loopback listener gets nothing); an agent that
fails, prints no report or runs past its time is masked ("agent_failed", "agent_timeout"), a
sandbox that cannot start is REDO, never a reward; the service refuses a black-box Reset without a
gateway or with one past its bounds; the sandbox's binds and extra environment are checked.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import threading
import time

import grpc
import pytest
from relayrl.common.grpc_server import start
from relayrl.common.sandbox import RunResult, Sandbox, SandboxLimits, SandboxUnavailable
from relayrl.common.sandbox.extras import check_binds, check_env, env_args
from relayrl.common.sandbox.runner import bwrap_argv
from relayrl.env.base import Action, EnvUnavailable, GatewayEndpoint, Outcome
from relayrl.env.config import EnvConfig
from relayrl.env.forward import GatewayForwarder
from relayrl.env.harness import CalcHarnessEnv, HarnessEnv, read_report
from relayrl.env.registry import ON_REQUEST, PluginError, _checked
from relayrl.env.server import build
from relayrl.env.v1 import env_pb2 as e
from relayrl.env.v1 import env_pb2_grpc

from tests.kit.openai_fake import FakeOpenAI, answer, tool_calls
from tests.kit.serving import client
from tests.kit.waits import error_of

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
TASK = {
    "prompt": [{"role": "user", "content": "What is 123 * 456?"}],
    "reward_model": {"ground_truth": "56088"},
    "data_source": "calc",
}
CALC_REPLIES = [tool_calls(("c1", "calc", '{"expression": "123 * 456"}')), answer("It is 56088.")]


@pytest.fixture(scope="module")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    box = Sandbox("full", workers=2)
    yield box
    box.close()


def _harness(tmp_path, program: str, **attrs) -> type[HarnessEnv]:
    """A calc harness whose agent is ``program``."""
    path = tmp_path / "agent.py"
    path.write_text(program)
    return type(
        "TestHarness", (CalcHarnessEnv,), {"name": "test/harness", "agent_program": str(path), **attrs}
    )


def _episode(cls: type[HarnessEnv], box, url: str, deadline: float | None = None):
    env = cls()
    env.sandbox, env.gateway = box, GatewayEndpoint(url, "sk-episode", "tiny-qwen")
    env.reset(TASK, 0)
    env.deadline = deadline
    try:
        assert env.step(Action("")) == ([], True, [])
        return env, env.reward()
    finally:
        env.close()


# ---- the host forwarder --------------------------------------------------------------------


def _echo_server() -> tuple[socket.socket, list[bytes]]:
    """A TCP server on 127.0.0.1 that echoes each connection until its end of file, then closes."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        with conn:
            got = bytearray()
            while chunk := conn.recv(1 << 16):
                got += chunk
                conn.sendall(chunk)
            seen.append(bytes(got))

    threading.Thread(target=serve, daemon=True).start()
    return server, seen


def _exchange(path: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(10)
        c.connect(path)
        sender = threading.Thread(target=lambda: (c.sendall(payload), c.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while chunk := c.recv(1 << 16):
            got += chunk
        sender.join()
        return bytes(got)


def test_the_host_forwarder_pipes_bytes_to_a_loopback_server():
    server, seen = _echo_server()
    try:
        fwd = GatewayForwarder(f"http://127.0.0.1:{server.getsockname()[1]}/v1", max_connections=2)
        assert stat.S_IMODE(os.stat(fwd.folder).st_mode) == 0o711  # the sandbox's user may pass
        assert stat.S_IMODE(os.stat(fwd.path).st_mode) == 0o666  # and connect
        payload = os.urandom(3 << 20)  # past the relay's buffers both ways: back-pressure
        assert _exchange(fwd.path, payload) == payload
        assert _exchange(fwd.path, b"hello") == b"hello"
        assert sorted(map(len, seen)) == [5, 3 << 20]
        # At most max_connections at once: the third is closed at once, the two go on.
        held = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        for s in held:
            s.connect(fwd.path)
            s.sendall(b"x")
            assert s.recv(1) == b"x"
        extra = socket.socket(socket.AF_UNIX)
        extra.settimeout(5)
        extra.connect(fwd.path)
        assert extra.recv(1) == b""
        assert fwd.relay.refused == 1
        fwd.close()
        for s in [*held, extra]:  # close ends the open connections too
            s.settimeout(5)
            assert s.recv(1) == b""
            s.close()
        assert not os.path.exists(fwd.folder)
        fwd.close()  # idempotent
    finally:
        server.close()


def test_a_gateway_that_refuses_closes_the_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with GatewayForwarder(f"http://127.0.0.1:{port}/v1") as fwd, socket.socket(socket.AF_UNIX) as c:
            c.settimeout(5)
            c.connect(fwd.path)
            assert c.recv(1) == b""


# ---- the agent in the sandbox --------------------------------------------------------------


@needs_bwrap
@pytest.mark.parametrize("tier", ["full", "rlimits-only"])
def test_the_calc_agent_plays_through_the_sandbox_and_the_forwarders(tier, sandbox):
    box = sandbox if tier == "full" else Sandbox(tier, workers=1)
    try:
        with FakeOpenAI(CALC_REPLIES) as fake:
            env, reward = _episode(CalcHarnessEnv, box, fake.url)
    finally:
        if box is not sandbox:
            box.close()
    assert reward.outcome == Outcome.OK and reward.reward == 1.0, reward
    assert reward.components == {"correctness": 1.0, "tool_calls": 1.0, "turns": 2.0}
    (path, auth, first), (_, _, second) = fake.requests
    assert path == "/v1/chat/completions" and auth == "Bearer sk-episode" and first["model"] == "tiny-qwen"
    assert first["messages"] == env.first_messages and first["tools"] == CalcHarnessEnv.tools
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "name": "calc",
        "content": "56088",
    }
    assert env.forwarder is None  # closed after the step


PROBE = """
import json, os, socket, urllib.request
spec = json.load(open(0))
port, gateway_port = (int(x) for x in spec["messages"][-1]["content"].split())
seen = {"interfaces": []}
for name in HOST_INTERFACES:  # looked up by name: the sandbox refuses netlink, so it lists none
    try:
        socket.if_nametoindex(name)
        seen["interfaces"].append(name)
    except OSError:
        pass
for name, where in (("listener", port), ("gateway_direct", gateway_port)):
    s = socket.socket()
    s.settimeout(1)
    try:
        s.connect(("127.0.0.1", where))
        seen[name] = "connected"
    except OSError as e:
        seen[name] = type(e).__name__
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=b"{}",
                             headers={"Content-Type": "application/json"})
seen["via_gateway"] = json.load(urllib.request.urlopen(req, timeout=10))["choices"][0]["message"]["content"]
seen["base_url"] = os.environ["OPENAI_BASE_URL"]
print(json.dumps({"final": json.dumps(seen), "turns": 1, "tool_calls": 0, "truncated": False}))
""".replace("HOST_INTERFACES", repr(sorted(n for _, n in socket.if_nameindex())))


@needs_bwrap
def test_inside_the_sandbox_the_agent_reaches_nothing_but_the_gateway(tmp_path, sandbox):
    cls = _harness(tmp_path, PROBE)
    with socket.create_server(("127.0.0.1", 0)) as listener, FakeOpenAI([answer("hi")]) as fake:
        listener.setblocking(False)
        env = cls()
        env.sandbox, env.gateway = sandbox, GatewayEndpoint(fake.url, "k", "m")
        task = {**TASK, "prompt": f"{listener.getsockname()[1]} {fake.port}"}
        env.reset(task, 0)
        env.step(Action(""))
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing arrived
    assert env.failure is None, env.failure
    seen = json.loads(env.task.transcript.final_text)
    assert seen["interfaces"] == ["lo"]
    assert seen["listener"] != "connected" and seen["gateway_direct"] != "connected"
    assert seen["via_gateway"] == "hi" and seen["base_url"] == "http://127.0.0.1:8000/v1"


@needs_bwrap
@pytest.mark.parametrize(
    "program, says",
    [
        ("import sys\nprint('boom: the agent broke', file=sys.stderr)\nsys.exit(1)", "exit status 1"),
        ("raise RuntimeError('agent bug')", "RuntimeError: agent bug"),
        ("print('no report here')", "printed no report"),
    ],
)
def test_an_agent_that_fails_is_masked_agent_failed(tmp_path, sandbox, program, says):
    with FakeOpenAI([]) as fake:
        _, reward = _episode(_harness(tmp_path, program), sandbox, fake.url)
    assert (reward.outcome, reward.failure_kind) == (Outcome.MASK, "agent_failed"), reward
    assert says in reward.failure_reason and len(reward.failure_reason) < 1000


@needs_bwrap
def test_an_agent_past_its_time_is_masked_agent_timeout(tmp_path, sandbox):
    cls = _harness(tmp_path, "import time\ntime.sleep(60)", agent_seconds=1.5)
    start = time.monotonic()
    with FakeOpenAI([]) as fake:
        _, reward = _episode(cls, sandbox, fake.url)
    assert (reward.outcome, reward.failure_kind) == (Outcome.MASK, "agent_timeout"), reward
    assert time.monotonic() - start < 10
    # The step's deadline cuts the agent's time too.
    with FakeOpenAI([]) as fake:
        _, reward = _episode(_harness(tmp_path, "pass"), sandbox, fake.url, deadline=time.monotonic() + 0.5)
    assert (reward.outcome, reward.failure_kind) == (Outcome.MASK, "agent_timeout")


class Broken:
    tier = "full"

    def run_sync(self, *args, **kwargs) -> RunResult:
        raise SandboxUnavailable("bwrap: setting up uid map: Permission denied")


def test_a_sandbox_that_cannot_start_is_env_unavailable_never_a_reward():
    env = CalcHarnessEnv()
    env.sandbox, env.gateway = Broken(), GatewayEndpoint("http://127.0.0.1:9/v1", "k", "m")
    env.reset(TASK, 0)
    with pytest.raises(EnvUnavailable) as raised:
        env.step(Action(""))
    assert raised.value.kind == "sandbox_unavailable" and env.forwarder is None


def test_a_report_must_have_the_right_shape():
    good = {"final": "1", "turns": 1, "tool_calls": 0, "truncated": False}
    assert read_report(json.dumps(good)) == good
    for bad in ({**good, "turns": -1}, {**good, "turns": True}, {**good, "truncated": 0}, [good]):
        assert read_report(json.dumps(bad)) is None
    assert read_report("") is None and read_report("{oops") is None


def test_a_harness_class_is_checked_when_defined(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        type("H", (CalcHarnessEnv,), {"agent_program": str(tmp_path / "missing.py")})
    with pytest.raises(ValueError, match="reserved name"):
        _harness(tmp_path, "pass", agent_files={"relay.py": __file__})
    with pytest.raises(TypeError, match="ToolEnv"):
        _harness(tmp_path, "pass", task_env=dict)
    assert CalcHarnessEnv.black_box and CalcHarnessEnv.needs_sandbox and CalcHarnessEnv.max_turns == 1
    assert ON_REQUEST["calc-harness"] == "relayrl.env.harness:CalcHarnessEnv"
    with pytest.raises(PluginError, match="black_box must be True or False"):
        _checked(type("X", (CalcHarnessEnv,), {"black_box": "yes"}), "x:X")


# ---- the sandbox's binds and environment ---------------------------------------------------


def test_binds_and_environment_are_checked_and_kept_off_the_command_line():
    assert check_binds({"/tmp": "/run/relayrl"}) == {"/tmp": "/run/relayrl"}
    for bad in ({"/nope/x": "/run/x"}, {"rel": "/run/x"}, {"/tmp": "/tmp/x"}, {"/tmp": "/run/../usr"}):
        with pytest.raises(ValueError):
            check_binds(bad)
    for bad in ({"PATH": "/x"}, {"A B": "1"}, {"A": "x\0y"}, {"A": "x" * 5000}):
        with pytest.raises(ValueError):
            check_env(bad)
    plain = bwrap_argv("bwrap", "/usr/bin/python3", SandboxLimits(), {"main.py": 5})
    assert plain.count("--ro-bind") == 1 and "--args" not in plain  # no binds, no env: as before
    argv = bwrap_argv(
        "bwrap", "/usr/bin/python3", SandboxLimits(), {"main.py": 5}, binds={"/x": "/run/x"}, env_fd=9
    )
    i, j = argv.index("/run/x"), argv.index("--args")
    assert argv[i - 2 : i + 1] == ["--ro-bind", "/x", "/run/x"] and argv[j + 1] == "9"
    assert j > argv.index("HOME") and argv.index("--remount-ro") > i  # after PATH/HOME; bound, then ro
    assert env_args({"K": "sk secret"}) == b"--setenv\0K\0sk secret\0"
    plain_tier = Sandbox("rlimits-only", workers=1)
    try:
        with pytest.raises(ValueError, match="binds need tier full"):
            plain_tier.run_sync("pass", binds={"/tmp": "/run/x"})
    finally:
        plain_tier.close()


@needs_bwrap
@pytest.mark.parametrize("tier", ["full", "rlimits-only"])
def test_the_job_gets_its_extra_environment(tier, sandbox):
    box = sandbox if tier == "full" else Sandbox(tier, workers=1)
    code = "import os\nprint(os.environ['OPENAI_API_KEY'], os.environ['PATH'])"
    try:
        r = box.run_sync(code, env={"OPENAI_API_KEY": "sk-1 two"})
    finally:
        if box is not sandbox:
            box.close()
    assert r.stdout == "sk-1 two /usr/bin:/bin\n", r


# ---- through the env service ---------------------------------------------------------------


def _reset(env: str, gateway: e.GatewayEndpoint | None = None, episode: str = "ep") -> e.ResetRequest:
    req = e.ResetRequest(env=env, task_json=json.dumps(TASK), episode_id=episode)
    if gateway is not None:
        req.gateway.CopyFrom(gateway)
    return req


async def test_the_service_hands_the_gateway_to_black_box_envs_and_checks_it():
    handle = build(EnvConfig(plugins=["tests.kit.openai_fake:GatewayEcho"]))
    await start(handle, ready=True)
    try:
        async with client(handle, env_pb2_grpc.EnvServiceStub) as s:
            envs = {x.name: x for x in (await s.stub.ListEnvs(e.ListEnvsRequest(), timeout=5)).envs}
            assert envs["test/gateway-echo"].black_box and not envs["calc"].black_box
            gw = e.GatewayEndpoint(base_url="http://10.0.0.7:8080/v1", api_key="sk-xyz", model="tiny")
            r = await s.stub.Reset(_reset("test/gateway-echo", gw), timeout=10)
            assert r.messages[0].content == "http://10.0.0.7:8080/v1 tiny 6"
            assert (await s.stub.Reset(_reset("calc", gw, "ep2"), timeout=10)).messages  # ignored there
            bad = [
                (None, "must carry a gateway"),
                (e.GatewayEndpoint(), "gateway.base_url is required"),
                (e.GatewayEndpoint(base_url="ftp://x/v1"), "http(s)://host"),
                (e.GatewayEndpoint(base_url="http://x:99999/v1"), "out of range"),
                (e.GatewayEndpoint(base_url="http://x/" + "v" * 600), "longer than 512"),
                (e.GatewayEndpoint(base_url="http://x/v 1"), "spaces"),
                (e.GatewayEndpoint(base_url="http://x/v1", api_key="k" * 257), "api_key is longer than 256"),
                (e.GatewayEndpoint(base_url="http://x/v1", model="m\r\nX: y"), "control characters"),
            ]
            for i, (gateway, says) in enumerate(bad):
                err = await error_of(
                    s.stub.Reset(_reset("test/gateway-echo", gateway, f"bad/{i}"), timeout=10)
                )
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details(), err.details()
    finally:
        await handle.stop(0)


@needs_bwrap
async def test_calc_harness_through_the_env_service():
    with FakeOpenAI(CALC_REPLIES) as fake:
        handle = build(EnvConfig(plugins=["relayrl.env.harness:CalcHarnessEnv"], sandbox={"workers": 1}))
        await start(handle, ready=True)
        try:
            async with client(handle, env_pb2_grpc.EnvServiceStub) as s:
                info = {x.name: x for x in (await s.stub.ListEnvs(e.ListEnvsRequest(), timeout=5)).envs}
                assert info["calc-harness"].black_box and info["calc-harness"].max_turns == 1
                gw = e.GatewayEndpoint(base_url=fake.url, api_key="sk-episode", model="tiny-qwen")
                r = await s.stub.Reset(_reset("calc-harness", gw), timeout=10)
                done = await s.stub.Step(
                    e.StepRequest(session_id=r.session_id, action=e.Action()), timeout=30
                )
                assert done.done and not done.observations
                closed = await s.stub.Close(e.CloseRequest(session_id=r.session_id), timeout=10)
                assert (closed.outcome, closed.reward) == (e.OUTCOME_OK, 1.0), closed
        finally:
            await handle.stop(0)
