"""Why a run ends before its last step, named: the failures the loop raises on purpose.

A ``RunFailure`` ends the run FAILED with its message (which names the service and the error
that caused it) and the command that resumes it from its last checkpoint; anything else is a bug
and is logged with its traceback. gRPC errors of the services keep their own type
(``grpc.aio.AioRpcError``): the registry reports their code and details the same way.
"""

from __future__ import annotations

import grpc


class RunFailure(RuntimeError):
    """A run cannot go on; the message says which service failed and how."""


class NoReplicaLeft(RunFailure):
    """Every replica of a service failed, and none came back in time."""


class AttemptsExhausted(RunFailure):
    """One piece of work failed on every attempt (``services.max_attempts``)."""


class ScoringFailed(RunFailure):
    """The reward service failed to score too many of a step's samples
    (``services.max_reward_error_fraction``)."""


class ServiceRpcError(grpc.aio.AioRpcError):
    """A service's gRPC error, with the service and the call it answered: a run that ends on
    it says which service failed (a bare DEADLINE_EXCEEDED names nobody). Still an
    ``AioRpcError`` with the same code and details, for callers that act on the code."""

    def __init__(self, e: grpc.aio.AioRpcError, service: str, rpc: str):
        super().__init__(
            e.code(), e.initial_metadata(), e.trailing_metadata(), e.details(), e.debug_error_string()
        )
        self.service, self.rpc = service, rpc


def describe(e: BaseException) -> str:
    """A failure in one line for a run's message: the service and call when known, the code
    and the details (bounded)."""
    if isinstance(e, grpc.aio.AioRpcError):
        where = f"{e.service} {e.rpc}: " if isinstance(e, ServiceRpcError) else ""
        return f"{where}{e.code().name}: {(e.details() or '')[:1000]}"
    return str(e)[:1500]
