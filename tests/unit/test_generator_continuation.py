"""The pieces that make version spans exact by construction (``relayrl.generator.continuation``):
the gate that orders request submissions and weight swaps, the per-sample accumulator, and the
stop string that a swap cut in two. The whole, on real vLLM, is tests/integration."""

from __future__ import annotations

import asyncio

import pytest
from relayrl.common.modelkit.tiny import tokenizer_corpus
from relayrl.common.modelkit.tokenizer import train_bpe
from relayrl.generator.continuation import Partial, SwapGate, straddling_stop


async def test_a_swap_waits_for_submissions_in_progress_and_holds_new_ones():
    gate, order = SwapGate(), []
    in_submit, release = asyncio.Event(), asyncio.Event()

    async def submit(name: str, hold: bool = False):
        async with gate.submit() as epoch:
            order.append((name, epoch))
            if hold:
                in_submit.set()
                await release.wait()

    async def swap():
        async with gate.swap():
            order.append(("swap", gate.epoch))
            await asyncio.sleep(0.01)

    first = asyncio.ensure_future(submit("a", hold=True))
    await in_submit.wait()
    swapping = asyncio.ensure_future(swap())
    await asyncio.sleep(0.01)
    late = asyncio.ensure_future(submit("b"))  # arrives while the swap waits: goes after it
    await asyncio.sleep(0.01)
    assert order == [("a", 0)] and not swapping.done() and not late.done()
    release.set()
    await asyncio.gather(first, swapping, late)
    assert order == [("a", 0), ("swap", 1), ("b", 1)]


async def test_a_cancelled_waiter_leaves_the_gate_usable():
    gate = SwapGate()
    held = asyncio.Event()

    async def hold():
        async with gate.submit():
            await held.wait()

    holder = asyncio.ensure_future(hold())
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(gate.swap().__aenter__())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    held.set()
    await holder
    async with asyncio.timeout(1):
        async with gate.submit() as epoch:  # neither a phantom swap nor a count left behind
            assert epoch == 0
        async with gate.swap():
            assert gate.swapping and gate.epoch == 1
    assert not gate.swapping


def test_partial_truncation_keeps_spans_consistent():
    p = Partial(2)
    p.extend(4, [1, 2, 3], [-0.1] * 3)
    p.extend(5, [4, 5], [-0.2] * 2)
    p.truncate(4)
    assert (p.token_ids, p.spans, len(p.logprobs)) == ([1, 2, 3, 4], [(4, 0, 3), (5, 3, 4)], 4)
    p.truncate(2)
    assert p.spans == [(4, 0, 2)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(tokenizer_corpus(0))


@pytest.mark.parametrize("stop", ["</answer>", "\n\n", "=> 9"])
def test_a_stop_string_cut_by_the_boundary_is_found_where_it_ends(tokenizer, stop):
    """With a real byte-level BPE: for every boundary, the stop is reported exactly when it
    starts before the boundary and ends after it, and the kept tokens end where it is complete."""
    text = f"reversing 48213 gives 31284 then {stop} and more text after it"
    assert text.count(stop) == 1  # a generator stops at the first one
    ids = tokenizer.encode(text).ids

    def decode(xs):
        return tokenizer.decode(list(xs), skip_special_tokens=False)

    start = text.index(stop)
    for boundary in range(1, len(ids)):
        head = len(decode(ids[:boundary]))
        cut = straddling_stop(ids, boundary, [stop], decode)
        straddles = start < head < start + len(stop)
        assert (cut is not None) == straddles, (boundary, head, cut)
        if cut is not None:
            assert stop in decode(ids[:cut]) and stop not in decode(ids[: cut - 1])
