"""deploy/make-secrets.sh and the TLS health probe.

The script's files are what compose and Kubernetes mount: a CA, a server certificate naming every
host callers and probes dial, a client certificate, a token. The probe (``python -m
relayrl.common.healthcheck``) is checked against a real ``grpc.aio`` server built by the shared
bootstrap with those files (TLS, mutual TLS, the token): SERVING with the CA and the client
certificate, and a clean failure, with a hint and within its deadline, without them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from relayrl.common import security
from relayrl.common.healthcheck import main as healthcheck_main
from relayrl.common.serving import ServeConfig

from tests.kit.deploy import (  # the token-env fixture applies to every test here
    FULL_NAME,
    SECRET_FILES,
    _no_token_env,  # noqa: F401
    make_secrets,
    reward_server,
    score,
)

REWARD = FULL_NAME["reward"]
COMPOSE_NAMES = ("reward", "env", "gateway", "generator", "learner", "coordinator")
K8S_NAMES = (
    "reward",
    "env",
    "gateway",
    "learner",
    "coordinator",
    "generator-0.generator-headless",
    "generator-7.generator-headless",
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("make-secrets") / "secrets"
    run = make_secrets(out, names=("relayrl.example.org", "10.1.2.3"))
    assert run.returncode == 0, run.stderr
    return out


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


# -- the script -------------------------------------------------------------------------------------
def test_make_secrets_writes_the_set_private_to_its_owner(pki):
    assert sorted(p.name for p in pki.iterdir()) == sorted([*SECRET_FILES, "ca.key"])
    assert stat.S_IMODE(pki.stat().st_mode) == 0o700  # other users of the machine stay out
    # Readable inside the folder: the containers' user (10001) owns nothing on the host.
    for name in SECRET_FILES:
        assert stat.S_IMODE((pki / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE((pki / "ca.key").stat().st_mode) == 0o600  # mounted nowhere
    token = (pki / "token").read_text()
    assert security.read_token(str(pki / "token")) == token.strip()
    assert len(token.strip()) == 64 and int(token, 16)


def test_make_secrets_certificates_name_every_host_callers_dial(pki):
    ca, server, client = (_cert(pki / f) for f in ("ca.crt", "tls.crt", "client.crt"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (server, client):
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = lambda c: list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)  # noqa: E731
    assert usage(server) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert usage(client) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(sans.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    # compose names, the Kubernetes Services and generator replicas, loopback, and the extra names
    assert {*COMPOSE_NAMES, *K8S_NAMES, "localhost", "relayrl.example.org"} <= dns
    assert {"127.0.0.1", "::1", "10.1.2.3"} <= ips
    assert "generator-8.generator-headless" not in dns  # --generators 8 by default
    assert ipaddress.ip_address("10.1.2.3")  # an IP given after OUT_DIR is an IP SAN, not a DNS one
    assert "10.1.2.3" not in dns


def test_make_secrets_refuses_to_overwrite_and_replaces_with_force(tmp_path):
    out = tmp_path / "s"
    assert make_secrets(out, "--generators", "2").returncode == 0
    before = {f: (out / f).read_bytes() for f in SECRET_FILES}
    again = make_secrets(out)
    assert again.returncode == 1 and "--force" in again.stderr
    assert {f: (out / f).read_bytes() for f in SECRET_FILES} == before
    assert make_secrets(out, "--force").returncode == 0
    assert (out / "token").read_bytes() != before["token"]
    assert (out / "ca.crt").read_bytes() != before["ca.crt"]  # a whole new set, never a mix
    bad = make_secrets(tmp_path / "t", "--days", "soon")
    assert bad.returncode == 2 and "whole numbers" in bad.stderr
    assert make_secrets(tmp_path / "u", "--bogus").returncode == 2


# -- the probe over TLS -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serve(pki) -> ServeConfig:
    """What every deployed service serves with: TLS, mutual TLS, the token."""
    return ServeConfig(
        tls_cert=str(pki / "tls.crt"),
        tls_key=str(pki / "tls.key"),
        tls_client_ca=str(pki / "ca.crt"),
        token_file=str(pki / "token"),
    )


def _tls(pki: Path, client: bool = True) -> list[str]:
    flags = ["--tls-ca", str(pki / "ca.crt")]
    return (
        [*flags, "--tls-cert", str(pki / "client.crt"), "--tls-key", str(pki / "client.key")]
        if client
        else flags
    )


async def _probe(*argv: str) -> int:
    return await asyncio.to_thread(healthcheck_main, list(argv))  # the loop keeps serving


async def test_probe_over_mutual_tls_answers_serving_without_a_token(pki, serve, capsys):
    async with reward_server(serve) as port:
        addr = f"127.0.0.1:{port}"
        assert await _probe(addr, *_tls(pki)) == 0
        assert await _probe(addr, REWARD, *_tls(pki)) == 0
        # The names callers dial are on the certificate too (the probe checks 127.0.0.1 by default).
        for name in ("reward", "env", "generator-0.generator-headless", "localhost"):
            assert await _probe(addr, REWARD, *_tls(pki), "--server-name", name) == 0, name
        # The token still guards the service itself.
        sec = dict(tls_ca=str(pki / "ca.crt"), client_cert=str(pki / "client.crt"))
        async with security.channel(addr, **sec, client_key=str(pki / "client.key")) as ch:
            with pytest.raises(Exception, match="UNAUTHENTICATED"):
                await score(ch)
    assert capsys.readouterr().err == ""


async def test_probe_reports_not_serving(pki, serve, capsys):
    async with reward_server(serve, ready=False) as port:
        assert await _probe(f"127.0.0.1:{port}", REWARD, *_tls(pki)) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


async def test_probe_without_the_ca_fails_fast_and_says_why(pki, serve, capsys):
    async with reward_server(serve) as port:
        addr = f"127.0.0.1:{port}"
        t0 = time.monotonic()
        assert await _probe(addr, "--timeout", "3") == 1  # plaintext to a TLS port
        assert time.monotonic() - t0 < 6
        err = capsys.readouterr().err
        assert "UNAVAILABLE" in err and "give --tls-ca" in err
        # TLS, but no client certificate for a service that asks for one (mutual TLS).
        assert await _probe(addr, "--timeout", "3", *_tls(pki, client=False)) == 1
        err = capsys.readouterr().err
        assert "UNAVAILABLE" in err and "--tls-cert" in err
        # A name the certificate does not hold.
        assert await _probe(addr, "--timeout", "3", *_tls(pki), "--server-name", "elsewhere.example") == 1
        assert "--server-name" in capsys.readouterr().err
    assert time.monotonic() - t0 < 20


async def test_probe_trusting_another_ca_fails(pki, serve, tmp_path, capsys):
    other = tmp_path / "other"
    assert make_secrets(other).returncode == 0
    async with reward_server(serve) as port:
        flags = ["--tls-ca", str(other / "ca.crt"), "--tls-cert", str(pki / "client.crt")]
        assert (
            await _probe(f"127.0.0.1:{port}", "--timeout", "3", *flags, "--tls-key", str(pki / "client.key"))
            == 1
        )
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_probe_settings_that_cannot_work_fail_with_a_message(pki, tmp_path, capsys):
    addr = "127.0.0.1:1"  # never dialled: the settings fail first
    assert healthcheck_main([addr, "--tls-ca", str(tmp_path / "missing.crt")]) == 1
    assert "--tls-ca: cannot read" in capsys.readouterr().err
    assert (
        healthcheck_main([addr, "--tls-ca", str(pki / "ca.crt"), "--tls-cert", str(pki / "client.crt")]) == 1
    )
    assert "go together" in capsys.readouterr().err
    assert (
        healthcheck_main([addr, "--tls-cert", str(pki / "client.crt"), "--tls-key", str(pki / "client.key")])
        == 1
    )
    assert "need --tls-ca" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no abbreviations: a probe line means exactly what it says
        healthcheck_main([addr, "--tls", str(pki / "ca.crt")])


async def test_probe_runs_as_a_module_over_tls(pki, serve):
    async with reward_server(serve) as port:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "relayrl.common.healthcheck",
            f"127.0.0.1:{port}",
            REWARD,
            *_tls(pki),
            stderr=subprocess.PIPE,
        )
        _out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
