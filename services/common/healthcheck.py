"""A gRPC health probe for container health checks, without a downloaded binary.

    python -m relayrl.common.healthcheck HOST:PORT [SERVICE] [--timeout SECONDS]

asks ``grpc.health.v1.Health/Check`` and exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING,
an unknown service name, no answer before the deadline), with the reason on stderr. SERVICE ``""``
(the default) asks whether the process is live; the service's full name (e.g.
``relayrl.reward.v1.RewardService``) whether it is ready. Plaintext only: health answers without a
token, and the probe runs next to the service (``127.0.0.1`` inside its container). Imports grpc
and nothing heavy, so a probe every few seconds stays cheap.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 5.0) -> tuple[bool, str]:
    """(serving, what was seen) for ``service`` at ``address``."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m relayrl.common.healthcheck",
        description="exit 0 when a gRPC service reports SERVING (grpc.health.v1)",
    )
    ap.add_argument("address", help="HOST:PORT of the service")
    ap.add_argument("service", nargs="?", default="", help='service name; "" (default) = the process is live')
    ap.add_argument("--timeout", type=float, default=5.0, help="deadline of the check in seconds")
    args = ap.parse_args(argv)
    ok, seen = check(args.address, args.service, args.timeout)
    if not ok:
        print(f"{args.address} {args.service or '(live)'}: {seen}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
