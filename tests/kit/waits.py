"""Waiting in tests: poll a condition until it holds or a deadline passes, and catch the gRPC
error a call ends with.

``until`` polls from a coroutine (the server under test runs on the same event loop and goes
on while it sleeps); ``until_blocking`` from plain code (threads, other processes). Both fail
the test with ``what`` at the deadline: a condition that never holds is a failure, not a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest


def _checks(pred: Callable[[], object], timeout: float, what: str) -> Iterator[None]:
    """Yield (for the caller to sleep) while ``pred()`` is false; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        yield


async def until(
    pred: Callable[[], object],
    timeout: float = 3.0,
    every: float = 0.005,
    what: str = "condition not reached",
) -> None:
    """Return once ``pred()`` is true, checked every ``every`` seconds for ``timeout`` seconds."""
    for _ in _checks(pred, timeout, what):
        await asyncio.sleep(every)


def until_blocking(
    pred: Callable[[], object],
    timeout: float = 3.0,
    every: float = 0.005,
    what: str = "condition not reached",
) -> None:
    """``until`` for code outside an event loop: sleeps the thread between checks."""
    for _ in _checks(pred, timeout, what):
        time.sleep(every)


async def error_of(call: Awaitable) -> grpc.aio.AioRpcError:
    """The ``AioRpcError`` that awaiting ``call`` raises; the test fails if it returns."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value
