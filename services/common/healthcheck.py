"""A gRPC health probe for container health checks, without a downloaded binary.

    python -m relayrl.common.healthcheck HOST:PORT [SERVICE] [--timeout SECONDS]
        [--tls-ca CA.pem [--tls-cert CERT.pem --tls-key KEY.pem] [--server-name NAME]]

asks ``grpc.health.v1.Health/Check`` and exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING,
an unknown service name, no answer before the deadline, a failed TLS handshake, an unreadable
file), with the reason on stderr. SERVICE ``""`` (the default) asks whether the process is live;
the service's full name (e.g. ``relayrl.reward.v1.RewardService``) whether it is ready.

Plaintext unless ``--tls-ca`` is given: then TLS, trusting that CA, presenting ``--tls-cert`` when
the service asks for a client certificate (mutual TLS). The probe runs next to the service and
dials ``127.0.0.1``, so the service's certificate must name 127.0.0.1, or ``--server-name`` says
which of its names to check instead. No token: health checks are open (``security.py``). Kubernetes'
own ``grpc:`` probe speaks plaintext only, which is why TLS deployments probe through this module.
Imports grpc and nothing heavy (no pydantic, no config), so a probe every few seconds stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class ProbeError(Exception):
    """A probe setting that cannot be used (an unreadable file, a key without its certificate)."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ProbeError(f"{what}: cannot read {path}: {e.strerror}") from None


def _channel(
    address: str,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    server_name: str | None,
) -> grpc.Channel:
    if not tls_ca:
        if tls_cert or tls_key or server_name:
            raise ProbeError("--tls-cert, --tls-key and --server-name need --tls-ca (they only apply to TLS)")
        return grpc.insecure_channel(address)
    if bool(tls_cert) != bool(tls_key):
        raise ProbeError("--tls-cert and --tls-key go together")
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca, "--tls-ca"),
        private_key=_read(tls_key, "--tls-key") if tls_key else None,
        certificate_chain=_read(tls_cert, "--tls-cert") if tls_cert else None,
    )
    # The name checked against the certificate (and sent as SNI); by default the host dialled.
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=options)


def check(
    address: str,
    service: str = "",
    timeout: float = 5.0,
    *,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    server_name: str | None = None,
) -> tuple[bool, str]:
    """(serving, what was seen) for ``service`` at ``address``; TLS when ``tls_ca`` is given."""
    try:
        channel = _channel(address, tls_ca, tls_cert, tls_key, server_name)
    except ProbeError as e:
        return False, str(e)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}{_hint(e.code(), bool(tls_ca))}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def _hint(code: grpc.StatusCode, tls: bool) -> str:
    """What to check when no connection came up: gRPC reports a TLS mismatch as UNAVAILABLE."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return ""
    if not tls:
        return " (if the service serves TLS, give --tls-ca)"
    return (
        " (if the TLS handshake failed: --tls-ca must be the CA of the service's certificate, which "
        "must name the host dialled or --server-name; with mutual TLS give --tls-cert and --tls-key)"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m relayrl.common.healthcheck",
        description="exit 0 when a gRPC service reports SERVING (grpc.health.v1)",
        allow_abbrev=False,  # a probe line is written once and must say exactly what it means
    )
    ap.add_argument("address", help="HOST:PORT of the service")
    ap.add_argument("service", nargs="?", default="", help='service name; "" (default) = the process is live')
    ap.add_argument("--timeout", type=float, default=5.0, help="deadline of the check in seconds")
    ap.add_argument("--tls-ca", help="PEM CA of the service's certificate: check over TLS")
    ap.add_argument("--tls-cert", help="PEM client certificate, for a service asking for one (mutual TLS)")
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert")
    ap.add_argument("--server-name", help="name to check the service's certificate against (default: HOST)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ok, seen = check(
        args.address,
        args.service,
        args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        server_name=args.server_name,
    )
    if not ok:
        print(f"{args.address} {args.service or '(live)'}: {seen}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
