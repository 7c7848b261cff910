"""Leaving a weight-sync group whose push broke, without waiting out its timeout.

A generator killed mid-push breaks the learner's broadcast, while the other generators wait for
the next bucket. Closing the learner's side does not reliably free them: a gloo receive posted
before the sender's connection closed can stay blocked until the group's timeout (minutes;
measured: about one push in three), and NCCL has no way to notice at all. Until then they serve
nothing and cannot join the next group. So the learner also marks the push abandoned in the
group's store (which it hosts), and receivers wait for each bucket in short slices, checking
that mark, or whether the store itself is gone, between them.

A group with work still pending cannot be dropped on the spot either: its destructor waits for
that work. ``retire`` drops it in a thread of its own.
"""

from __future__ import annotations

import sys
import threading
import time

ABANDONED = "abandoned"
CHECK_EVERY_S = 1.0


def abandon(store) -> None:
    """Mark the group's current push abandoned (the learner's side, before it leaves)."""
    try:
        store.set(ABANDONED, "1")
    except Exception:  # a store already gone says the same to the receivers
        pass


def abandoned(store) -> bool:
    """Whether the learner abandoned the push: the mark is set, or its store no longer answers
    (the learner left the group, or died)."""
    try:
        return bool(store.check([ABANDONED]))
    except Exception:  # torch raises several kinds for a closed connection
        return True


def wait_received(work, store, check_every_s: float = CHECK_EVERY_S) -> None:
    """Wait for one receive of the group (the group's own timeout still bounds it); raise
    RuntimeError as soon as the learner abandoned the push."""
    next_check = time.monotonic() + check_every_s
    nap = 1e-4  # short at first: most buckets arrive within milliseconds
    while not work.is_completed():
        if time.monotonic() >= next_check:
            if abandoned(store):
                raise RuntimeError("the learner abandoned this push (a member of its group failed)")
            next_check = time.monotonic() + check_every_s
        time.sleep(nap)
        nap = min(2 * nap, 0.02)
    work.wait()  # raises the receive's own error, if it failed


def retire(holder: list, settle_s: float = 5.0) -> None:
    """Drop the group in ``holder`` (a one-item list that holds the caller's last reference) in a
    background thread: its destructor may wait for pending work up to the group's timeout. The
    thread lets the caller's frame go first (at most ``settle_s``), so the drop happens there."""
    if not holder:
        return

    def drop() -> None:
        deadline = time.monotonic() + settle_s
        while sys.getrefcount(holder[0]) > 2 and time.monotonic() < deadline:  # 2: list + argument
            time.sleep(0.01)
        holder.clear()

    threading.Thread(target=drop, name="relayrl-retire-group", daemon=True).start()
