"""Errors at service boundaries: domain exceptions -> gRPC status codes, in one place.

Inside a service, code raises the exceptions below (or lets anything else propagate). Only the
servicer maps them, through ``map_errors``: bad request -> INVALID_ARGUMENT, not ready or mid
swap -> UNAVAILABLE, wrong version or state -> FAILED_PRECONDITION, queue full ->
RESOURCE_EXHAUSTED, anything else -> logged with its traceback, INTERNAL. Errors travel as gRPC
status, never as an error field inside a success message.

``map_errors`` also checks every request message before the servicer sees it: bytes that do not
decode (``decoder`` hands them over as ``Undecodable`` instead of failing inside gRPC, which
would answer UNKNOWN) and fields the contract does not know are INVALID_ARGUMENT. Status details
are capped (``MAX_DETAIL_CHARS``): a message that quotes a huge input must not grow past what
gRPC's trailers carry and turn into an unrelated RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
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


class AlreadyExists(ServiceError):
    """What the request would create exists already (a run folder)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    """The request is well-formed but the service's state does not allow it (version, step)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    """Not ready yet, shutting down, or mid weight swap: retry later, possibly elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ServiceError):
    """Data arrived corrupted (e.g. weight bytes whose checksum does not match)."""

    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(ServiceError):
    """The caller's deadline passed before the work started (so none of it was done)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class OutOfRange(ServiceError):
    """A value past the end of what the service holds (e.g. a prompt that fills the context)."""

    code = grpc.StatusCode.OUT_OF_RANGE


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
        raise InvalidRequest(bounded("; ".join(bad)) + " (client built from a newer contract?)")


MAX_DETAIL_CHARS = 1000
"""Longest status message a service sends (gRPC carries it in a trailer of a few KiB)."""


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out.

    >>> bounded("x" * 10, 4)
    'xxxx... (6 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class Undecodable:
    """What ``decoder`` hands a servicer for bytes that are not the expected message."""

    def __init__(self, why: str) -> None:
        self.why = why


def decoder(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer that never raises: bad bytes become ``Undecodable``."""

    def decode(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError, and RecursionError on absurd nesting
            return Undecodable(f"request is not a valid {cls.DESCRIPTOR.full_name}: {bounded(str(e), 200)}")

    return decode


def checked(msg: Any) -> Message:
    """A request message fit for a servicer, or InvalidRequest: undecodable or unknown fields."""
    if isinstance(msg, Undecodable):
        raise InvalidRequest(msg.why)
    check_no_unknown_fields(msg)
    return msg


async def _checked_stream(requests):
    async for msg in requests:
        yield checked(msg)


def _checked_request(request: Any) -> Any:
    if isinstance(request, Message | Undecodable):
        return checked(request)
    return _checked_stream(request)  # a client stream: each message checked as it arrives


async def to_the_end(work: Awaitable[Any], stay: bool = False) -> Any:
    """Await ``work`` run as a task of its own that goes on if the caller is cancelled (a client
    cancelled or its deadline passed): a weight swap or a collective op stopped half-way would
    leave state that nothing records. A cancelled caller leaves at once, or with ``stay`` waits
    for the work to end first and then re-raises (a membership change whose caller holds a lock
    the next one needs). Its failure is retrieved here (and logged at debug level), so a task
    whose caller left does not end as "exception was never retrieved"."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_log_orphan_failure)
    try:
        # wait: as long as ``work``, whose own waits are bounded where it is written
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if stay and not task.done():
            await task  # wait: as above
        raise


def _log_orphan_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("shielded work failed: %r", task.exception())


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, bounded(str(exc))
    logger.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(exc).__name__}: {exc}")


def map_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (unary or server-streaming; a client stream is checked message
    by message) to check its request and map exceptions to statuses."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, _checked_request(request), context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                code, msg = _status_for(e)
                await context.abort(code, msg)

        stream.maps_errors = True
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, _checked_request(request), context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code, msg = _status_for(e)
            await context.abort(code, msg)

    unary.maps_errors = True
    return unary
