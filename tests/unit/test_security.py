"""Who may call: TLS, mutual TLS and the bearer token over a real grpc.aio server on port 0.

A throwaway CA, a server certificate (for 127.0.0.1 and localhost) and a client certificate are
made here with ``cryptography``. The server is ``create_server`` around a small RewardService, so
what is checked is the bootstrap every service uses: a call without the token or with another one
ends UNAUTHENTICATED, the right token over TLS is answered, health checks need no token, mutual
TLS turns away a client without a certificate; the loopback rule (``check_bind``), the client
channels (aio and sync, streaming calls included) and ``relayrl serve`` refusing an open bind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError
from relayrl.common import security
from relayrl.common.grpc_server import create_server, start
from relayrl.common.serving import TOKEN_FILE_ENV, ClientSecurity, ServeConfig
from relayrl.reward.v1 import reward_pb2 as r
from relayrl.reward.v1 import reward_pb2_grpc

from tests.kit.pki import CA, CLIENT, certificate, new_key, write_pem

DESCRIPTOR = r.DESCRIPTOR.services_by_name["RewardService"]
SERVICE = DESCRIPTOR.full_name
TOKEN = "s3cret-token-0123456789"
SERVING = health_pb2.HealthCheckResponse.SERVING
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


# -- a throwaway PKI ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("pki")
    ca = CA.create(d)
    # A client certificate that signs itself: not from the CA the server trusts.
    other = new_key()
    stranger = certificate("stranger", "stranger", other, other, usage=CLIENT)
    token = d / "token"
    token.write_text(TOKEN + "\n")  # a trailing newline, as `echo` and k8s secrets leave it
    wrong = d / "wrong-token"
    wrong.write_text("not-the-token")
    return SimpleNamespace(
        ca=ca.path,
        server=ca.issue("reward", "localhost", "127.0.0.1"),
        client=ca.issue("coordinator", usage=CLIENT),
        stranger=write_pem(d, "stranger", stranger, other),
        token=str(token),
        wrong_token=str(wrong),
    )


# -- a server through the shared bootstrap --------------------------------------------------------
class _Reward(reward_pb2_grpc.RewardServiceServicer):
    async def Score(self, request, context):
        return r.ScoreResponse(
            results=[r.RewardResult(sample_id=i.sample_id, reward=1.0) for i in request.items]
        )


@contextlib.asynccontextmanager
async def served(**serve):
    handle = create_server(_Reward(), DESCRIPTOR, ServeConfig(**serve))
    await start(handle, ready=True)
    try:
        yield f"127.0.0.1:{handle.port}"
    finally:
        await handle.stop(0)


async def _score(ch: grpc.aio.Channel) -> r.ScoreResponse:
    return await reward_pb2_grpc.RewardServiceStub(ch).Score(
        r.ScoreRequest(items=[r.RewardInput(sample_id="a")]), timeout=10
    )


async def _code(ch: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _score(ch)
    return err.value.code()


async def test_token_over_tls(pki):
    async with served(tls_cert=pki.server[0], tls_key=pki.server[1], token_file=pki.token) as addr:
        async with security.channel(addr, tls_ca=pki.ca) as ch:  # TLS, no token
            assert await _code(ch) == UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch)  # probes need no token
            for name in ("", SERVICE):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert resp.status == SERVING
        async with security.channel(addr, tls_ca=pki.ca, token="not-the-token") as ch:
            assert await _code(ch) == UNAUTHENTICATED
        async with security.channel(addr, tls_ca=pki.ca, token=TOKEN) as ch:
            assert (await _score(ch)).results[0].reward == 1.0
            # A server-streaming call through the token interceptors (Health.Watch).
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            async for resp in watch:
                assert resp.status == SERVING
                break
            watch.cancel()
        async with grpc.aio.insecure_channel(addr) as ch:  # plaintext to a TLS port
            assert await _code(ch) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_turns_away_clients_without_a_certificate_from_the_ca(pki):
    async with served(tls_cert=pki.server[0], tls_key=pki.server[1], tls_client_ca=pki.ca) as addr:
        async with security.channel(addr, tls_ca=pki.ca, token=TOKEN) as ch:
            assert await _code(ch) == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        stranger = dict(client_cert=pki.stranger[0], client_key=pki.stranger[1])
        async with security.channel(addr, tls_ca=pki.ca, **stranger) as ch:
            assert await _code(ch) == grpc.StatusCode.UNAVAILABLE
        async with security.channel(
            addr, tls_ca=pki.ca, client_cert=pki.client[0], client_key=pki.client[1]
        ) as ch:
            assert (await _score(ch)).results[0].reward == 1.0


async def test_client_security_config_and_the_token_file_variable(pki, monkeypatch):
    """``client_channel`` from a ``ClientSecurity``; $RELAYRL_TOKEN_FILE on both sides."""
    monkeypatch.setenv(TOKEN_FILE_ENV, pki.token)
    async with served(tls_cert=pki.server[0], tls_key=pki.server[1], tls_client_ca=pki.ca) as addr:
        sec = ClientSecurity(ca=pki.ca, cert=pki.client[0], key=pki.client[1])
        async with security.client_channel(addr, sec) as ch:
            assert (await _score(ch)).results[0].reward == 1.0
        wrong = sec.model_copy(update={"token_file": pki.wrong_token})  # the config beats the variable
        async with security.client_channel(addr, wrong) as ch:
            assert await _code(ch) == UNAUTHENTICATED


async def test_token_on_loopback_without_tls(pki):
    async with served(token_file=pki.token) as addr:
        async with grpc.aio.insecure_channel(addr) as ch:
            assert await _code(ch) == UNAUTHENTICATED
        async with security.channel(addr, token=TOKEN) as ch:
            assert (await _score(ch)).results[0].reward == 1.0


async def test_unknown_methods_are_unauthenticated_not_unimplemented(pki):
    async with served(token_file=pki.token) as addr:
        async with grpc.aio.insecure_channel(addr) as ch:
            call = ch.unary_unary("/relayrl.nothing.v1.Nope/Call")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"", timeout=10)
            assert err.value.code() == UNAUTHENTICATED


async def test_sync_channel_for_the_cli(pki):
    def calls(addr: str) -> None:  # blocking, as ``relayrl status`` makes them
        with security.sync_channel(addr, tls_ca=pki.ca, token=TOKEN) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            assert stub.Score(r.ScoreRequest(items=[r.RewardInput(sample_id="a")]), timeout=10).results
        with security.sync_channel(addr, tls_ca=pki.ca) as ch:
            with pytest.raises(grpc.RpcError) as err:
                reward_pb2_grpc.RewardServiceStub(ch).Score(r.ScoreRequest(), timeout=10)
            assert err.value.code() == UNAUTHENTICATED

    async with served(tls_cert=pki.server[0], tls_key=pki.server[1], token_file=pki.token) as addr:
        await asyncio.to_thread(calls, addr)


# -- the loopback rule ----------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gen-0.relayrl.svc"])
def test_open_bind_without_tls_is_refused(host):
    with pytest.raises(security.SecurityError, match="--insecure"):
        security.check_bind(host, tls=False, insecure=False)
    with pytest.raises(security.SecurityError, match="--token-file"):
        security.check_bind(host, tls=True, insecure=False, authenticated=False)
    security.check_bind(host, tls=False, insecure=True)
    security.check_bind(host, tls=True, insecure=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_nothing(host):
    security.check_bind(host, tls=False, insecure=False, authenticated=False)


def test_create_server_refuses_before_binding(pki):
    with pytest.raises(security.SecurityError, match="--insecure"):
        create_server(_Reward(), DESCRIPTOR, ServeConfig(host="0.0.0.0"))
    with pytest.raises(security.SecurityError, match="cannot read"):
        create_server(_Reward(), DESCRIPTOR, ServeConfig(token_file=pki.token + ".missing"))


def test_config_validation(pki, tmp_path):
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        ServeConfig(tls_cert=pki.server[0])
    with pytest.raises(ValidationError, match="needs tls_cert"):
        ServeConfig(tls_client_ca=pki.ca)
    with pytest.raises(ValidationError, match="needs ca"):
        ClientSecurity(cert=pki.client[0], key=pki.client[1])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(security.SecurityError, match="empty"):
        security.read_token(str(empty))
    two = tmp_path / "two"
    two.write_text("a b")
    with pytest.raises(security.SecurityError, match="one word"):
        security.read_token(str(two))
    assert security.read_token(pki.token) == TOKEN


def test_experiment_learner_calls_generators_like_the_coordinator(tmp_path):
    from relayrl.coordinator.config import ExperimentConfig
    from relayrl.coordinator.derive import resolve_paths

    exp = ExperimentConfig(
        model={"path": "m"}, data={"train": "t.jsonl"}, services={"security": {"ca": "certs/ca.pem"}}
    )
    exp = resolve_paths(exp, tmp_path)
    assert exp.services.security.ca == str(tmp_path / "certs" / "ca.pem")
    assert exp.learner.security == exp.services.security


def test_serve_cli_refuses_an_open_bind_without_tls(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "serve", "reward", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "--insecure" in proc.stderr
    assert "ready" not in proc.stdout  # it stopped before serving or starting workers


def _read_in_a_thread(read, path: str) -> BaseException | object:
    """``read(path)``'s result or error, from a daemon thread joined with a bound: a read that
    blocks (a FIFO) or never ends (/dev/zero) fails the test instead of hanging the suite."""
    out: list = []

    def run() -> None:
        try:
            out.append(read(path))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"reading {path} did not return"
    return out[0]


@pytest.mark.parametrize("read", [security.read_token, lambda p: security.read_file(p, "tls ca")])
def test_secret_files_are_small_regular_files(tmp_path, read):
    # A config names any path: /dev/zero read whole never ends, a FIFO blocks its reader.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (security.MAX_PEM_FILE_BYTES + 1))
    for path, needle in [
        (str(fifo), "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (str(tmp_path), "not a regular file"),
        (str(big), "larger than"),
        (str(tmp_path / "a\0b"), "cannot read"),
    ]:
        got = _read_in_a_thread(read, path)
        assert isinstance(got, security.SecurityError) and needle in str(got), (path, got)


def test_a_token_file_is_at_most_64_kib(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * (64 << 10) + "\n")
    with pytest.raises(security.SecurityError, match="larger than 65536 bytes"):
        security.read_token(str(token))
    token.write_text("t" * 1000 + "\n")
    assert security.read_token(str(token)) == "t" * 1000
