"""Exact version spans: every vLLM request runs under one set of weights, start to finish.

A weight swap does not relabel requests in flight, it interrupts them. The swap waits until no
request is being submitted, increments the gate's epoch, pauses vLLM in ``abort`` mode (every
request in the engine ends; the engine is idle when the pause returns), loads, resumes. A sample
whose request ended that way continues as a new request whose prompt is the original prompt plus
every token it has so far, submitted once the swap is over. So, by construction:

* a request is only ever submitted through :meth:`SwapGate.submit`, which reads the policy
  version while no swap can start, and the weights cannot change while it runs (a swap first ends
  every request); the tokens it returns therefore come from exactly that version;
* tokens after a boundary are what the new policy produces given the prefix, because the
  continuation's prefill recomputes the whole prefix with the new weights (nothing computed with
  the old ones is reused: the pause also clears the prefix cache).

No vLLM bookkeeping (weight-version labels, preemption of running requests) is relied on, so the
same holds for every vLLM scheduler (async scheduling, Model Runner V2 on GPUs). AReaL calls this
interruptible generation.

:class:`Partial` accumulates one sample across its requests; :func:`straddling_stop` finds a stop
string that the boundary cut in two, which neither request could see whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


class SwapGate:
    """Submissions are readers, a swap is the writer (and is preferred once it waits).

    ``epoch`` counts swaps that started: a request that ends in ``abort`` while the epoch differs
    from the one it was submitted under was interrupted by a swap and should continue.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._submitting = 0
        self._swaps_waiting = 0
        self._swapping = False
        self.epoch = 0

    @property
    def swapping(self) -> bool:
        return self._swapping

    @asynccontextmanager
    async def submit(self) -> AsyncIterator[int]:
        """Hold while adding a request: no swap starts until the block exits. Yields the epoch."""
        # wait: the condition's lock is held only between awaits (never across one), and a swap
        # ends within its bounds (vllm_weights: control calls ENGINE_CALL_S, the load its
        # transport's timeouts, or the engine's death); the caller's deadline cancels the wait
        async with self._cond:
            # wait: as above
            await self._cond.wait_for(lambda: not self._swapping and not self._swaps_waiting)
            self._submitting += 1
        try:
            yield self.epoch
        finally:
            async with self._cond:  # wait: held between awaits only
                self._submitting -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def swap(self) -> AsyncIterator[None]:
        """Hold while the weights change: waits for submissions in progress, blocks new ones."""
        # wait: submissions in progress end after one add_request (milliseconds); swaps come one
        # at a time (the engine's swap lock)
        async with self._cond:
            self._swaps_waiting += 1
            try:
                # wait: as above
                await self._cond.wait_for(lambda: not self._swapping and not self._submitting)
            finally:
                self._swaps_waiting -= 1
            self._swapping = True
            self.epoch += 1
        try:
            yield
        finally:
            async with self._cond:  # wait: held between awaits only
                self._swapping = False
                self._cond.notify_all()


@dataclass
class Partial:
    """One sample assembled from the requests that produced it."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end)

    def extend(self, version: int, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Append tokens produced by ``version``; adjacent tokens of one version share a span.

        >>> p = Partial(0)
        >>> p.extend(1, [5, 6], [-0.1, -0.2]); p.extend(1, [7], [-0.3]); p.extend(2, [8], [-0.4])
        >>> p.spans, p.token_ids
        ([(1, 0, 3), (2, 3, 4)], [5, 6, 7, 8])
        """
        if not token_ids:
            return
        start, end = len(self.token_ids), len(self.token_ids) + len(token_ids)
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1] = (version, self.spans[-1][1], end)
        else:
            self.spans.append((version, start, end))

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (a stop string completed at token ``n - 1``)."""
        del self.token_ids[n:], self.logprobs[n:]
        self.spans = [(v, a, min(b, n)) for v, a, b in self.spans if a < n]


def straddling_stop(
    token_ids: Sequence[int],
    boundary: int,
    stops: Sequence[str],
    decode: Callable[[Sequence[int]], str],
) -> int | None:
    """Where a stop string cut by the boundary ends: the number of tokens to keep, or None.

    vLLM checks stop strings within one request's output. When a swap splits a sample at token
    ``boundary``, a stop string that begins before it and ends after it is seen by neither
    request. Only a window of tokens around the boundary can hold one (each token decodes to at
    least one character, else it is part of a longer character), so the work is bounded by the
    longest stop string, not by the sample.

    >>> text = "ab</s>cd"          # one character per token here
    >>> ids = [ord(c) for c in text]
    >>> dec = lambda ids: "".join(map(chr, ids))
    >>> straddling_stop(ids, 3, ["</s>"], dec)   # "ab<" | "/s>cd": the stop ends at token 6
    6
    >>> straddling_stop(ids, 6, ["</s>"], dec) is None   # whole before the boundary: vLLM saw it
    True
    >>> straddling_stop(ids, 1, ["</s>"], dec) is None   # whole after it: vLLM saw it too
    True
    """
    if not stops or not 0 < boundary < len(token_ids):
        return None
    reach = 4 * max(len(s) for s in stops)  # tokens; 4 bytes per character at most
    lo = max(0, boundary - reach)
    head = decode(token_ids[lo:boundary])
    for end in range(boundary + 1, min(len(token_ids), boundary + reach) + 1):
        text = decode(token_ids[lo:end])
        for s in stops:
            at = text.find(s, max(0, len(head) - len(s) + 1))
            if 0 <= at < len(head):  # starts before the boundary, ends after it
                return end
    return None
