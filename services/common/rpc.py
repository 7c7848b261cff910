"""Errors at service boundaries: domain exceptions -> gRPC status codes, in one place.

Inside a service, code raises the exceptions below (or lets anything else propagate). Only the
servicer maps them, through ``map_errors``: bad request -> INVALID_ARGUMENT, not ready or mid
swap -> UNAVAILABLE, wrong version or state -> FAILED_PRECONDITION, queue full ->
RESOURCE_EXHAUSTED, anything else -> logged with its traceback, INTERNAL. Errors travel as gRPC
status, never as an error field inside a success message.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """Base of the errors a servicer turns into a gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(ServiceError, ValueError):
    """The request itself is wrong; retrying it unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """The named thing (experiment, checkpoint) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    """The request is well-formed but the service's state does not allow it (version, step)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    """Not ready yet, shutting down, or mid weight swap: retry later, possibly elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ServiceError):
    """Data arrived corrupted (e.g. weight bytes whose checksum does not match)."""

    code = grpc.StatusCode.DATA_LOSS


class ResourceExhausted(ServiceError):
    """Too much queued already."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def unknown_fields(msg: Message, path: str = "") -> list[str]:
    """Field numbers the receiver's contract does not know, anywhere in ``msg``.

    A client built from a newer contract may send fields this server would silently drop;
    we reject them instead so a user never believes a setting took effect when it did not.
    """
    from google.protobuf import unknown_fields as uf

    here = path or msg.DESCRIPTOR.name
    found = [f"{here}: unknown field number {f.field_number}" for f in uf.UnknownFieldSet(msg)]
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        if fd.is_repeated:
            for i, item in enumerate(value):
                found += unknown_fields(item, f"{here}.{fd.name}[{i}]")
        else:
            found += unknown_fields(value, f"{here}.{fd.name}")
    return found


def check_no_unknown_fields(msg: Message) -> None:
    if bad := unknown_fields(msg):
        raise InvalidRequest("; ".join(bad) + " (client built from a newer contract?)")


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    logger.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def map_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (unary or server-streaming) to map exceptions to statuses."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                code, msg = _status_for(e)
                await context.abort(code, msg)

        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code, msg = _status_for(e)
            await context.abort(code, msg)

    return unary
