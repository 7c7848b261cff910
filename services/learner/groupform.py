"""Forming a weight-sync group: rank 0 (this learner) joins while every member is asked to.

Rank 0 joins in a thread of its own, not the event loop's pool: a member that refuses to join
(or whose call fails) never arrives, and the join would hold a pool thread until the group's
timeout (minutes). The first refusal ends the formation at once, naming the member.

The members that did accept are then inside gloo's rendezvous, waiting for the absent ranks:
each one's engine would be frozen (vLLM runs the join as one call) until the group's timeout.
So the learner joins in the absent ranks' place, the group completes, and every joined rank
here is shut down: the members come back at once and leave it at their next InitWeightSync.
(NCCL forms its communicators at the first collective: its members never wait here.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from relayrl.common.rpc import Unavailable
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.group import open_group_with_store

logger = logging.getLogger(__name__)


def join_in_thread(
    host: str, port: int, world_size: int, backend: str, timeout_s: float, rank: int = 0, store=None
) -> asyncio.Future:
    """This process's join of a new group as ``rank`` (0: the learner's own, over ``store``
    when it made it already: ``group.master_store``), as a future of (ProcessGroup, store) that
    a daemon thread settles. Cancel the future to give the join up: a group formed after that is
    shut down."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.cancelled():
            if result is not None:
                logger.info("a %s group formed after it was given up: shut down", backend)
                groupwait.release([result[0]], backend == "nccl", 1.0)
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = open_group_with_store(host, port, world_size, rank, backend, timeout_s, store=store)
        except Exception as e:
            error = e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone (the learner is stopping)
            pass

    threading.Thread(target=run, name="relayrl-join-group", daemon=True).start()
    return fut


async def form(
    joined: asyncio.Future,
    calls: dict[str, asyncio.Future],
    ranks: dict[str, range],
    where: tuple[str, int, int, float],
    backend: str,
    why: Callable[[BaseException], str],
) -> tuple[object, object]:
    """Wait until rank 0 has ``joined`` and every member's InitWeightSync ``calls`` answered; the
    first member that refuses (or fails) ends it at once with UNAVAILABLE naming it, its
    ``ranks`` taken here (``where``: host, port, world size, timeout) so that the others are
    not left waiting. Returns (ProcessGroup, store); on any failure nothing is left joined."""
    try:
        while True:
            waiting: set[Awaitable] = {joined, *(c for c in calls.values() if not c.done())}
            # wait: the join ends at the group's timeout (the store's), each call at its RPC timeout
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if bad := {r: c for r, c in calls.items() if c.done() and (c.cancelled() or c.exception())}:
                if backend == "gloo":
                    _stand_in([k for r in bad for k in ranks[r]], where)
                raise Unavailable(
                    f"generators did not join the {backend} weight-sync group: "
                    + "; ".join(f"{r}: {why(_error(c))}" for r, c in sorted(bad.items()))
                )
            if joined.done() and joined.exception() is not None:
                raise Unavailable(f"{backend} weight-sync group did not form: {joined.exception()}")
            if joined.done() and all(c.done() for c in calls.values()):
                return joined.result()
    except BaseException:
        if joined.done() and not joined.cancelled() and joined.exception() is None:
            groupwait.release([joined.result()[0]], backend == "nccl", 1.0)
        joined.cancel()  # a group that forms later is shut down as it does
        for c in calls.values():
            c.cancel()
        raise


def _stand_in(ranks: list[int], where: tuple[str, int, int, float]) -> None:
    """Join as each of ``ranks`` (absent members'), each shut down once the group formed."""
    host, port, world_size, timeout_s = where
    for k in ranks:
        join_in_thread(host, port, world_size, "gloo", timeout_s, rank=k).cancel()


def _error(call: asyncio.Future) -> BaseException:
    return asyncio.CancelledError("cancelled") if call.cancelled() else call.exception()
