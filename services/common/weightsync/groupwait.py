"""Leaving a weight-sync group whose push broke, without waiting out its timeout.

A generator killed mid-push breaks the learner's broadcast, while the other generators wait for
the next bucket. Closing the learner's side does not reliably free them: a gloo receive posted
before the sender's connection closed can stay blocked until the group's timeout (minutes;
measured: about one push in three), and NCCL has no way to notice at all. Until then they serve
nothing and cannot join the next group. So the learner also marks the push abandoned in the
group's store (which it hosts), and receivers wait for each bucket in short slices, checking
that mark, or whether the store itself is gone, between them.

A group with work still pending cannot be dropped on the spot either: its destructor waits for
that work, holding the GIL. ``retire`` keeps it until the group's timeout has passed.
"""

from __future__ import annotations

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


def retire(holder: list, after_s: float) -> None:
    """Drop the group in ``holder`` (a one-item list that holds the caller's last reference)
    ``after_s`` seconds from now, in a background thread. A group destroyed with work pending
    waits for that work in its destructor, holding the GIL: the whole process would freeze until
    the group's timeout. Past that timeout the pending work has failed and the drop is quick."""
    if not holder:
        return

    def drop() -> None:
        time.sleep(after_s)
        holder.clear()

    threading.Thread(target=drop, name="relayrl-retire-group", daemon=True).start()


def release(holder: list, on_gpu: bool, after_s: float) -> None:
    """Leave the group in ``holder`` (see ``retire``): NCCL is aborted (a kernel may still wait
    on the stream), gloo shut down, then the group is retired."""
    try:
        if on_gpu:
            holder[0].abort()
        else:
            holder[0].shutdown()
    except Exception:  # an already broken group cannot always shut down cleanly
        pass
    retire(holder, after_s)
