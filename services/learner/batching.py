"""Pure batching: spread samples over ranks by token count, then cut each share into micro-batches.

ZeRO-3 reduces gradients inside every backward pass, a collective call: all ranks must run the
same number of micro-batches. ``plan_step`` balances tokens across ranks (longest-first greedy,
which keeps the heaviest rank within one sample of the mean) and pads every rank to the same
micro-batch count with empty micro-batches (a zero-weight forward/backward). Padded
micro-batches count padded tokens (samples x longest) against the budget; packed ones
(``packing.pack``) count real tokens.
"""

from __future__ import annotations

from relayrl.learner.packing import pack


def balance(lengths: list[int], world_size: int) -> list[list[int]]:
    """Indices per rank, longest sample first onto the lightest rank.

    >>> balance([5, 1, 4, 2, 3], 2)
    [[0, 3, 1], [2, 4]]
    """
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    return ranks


def micro_batches(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Cut ``indices`` (in order) into micro-batches of at most ``max_tokens`` padded tokens
    (count x longest); a single longer sample gets a micro-batch of its own.

    >>> micro_batches([0, 1, 2], [4, 4, 9], 8)
    [[0, 1], [2]]
    """
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in indices:
        new_longest = max(longest, lengths[i])
        if cur and new_longest * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        out.append(cur)
    return out


def plan_step(
    lengths: list[int], world_size: int, max_tokens: int, packed: bool = False
) -> list[list[list[int]]]:
    """Per rank, the micro-batches (lists of sample indices), every rank with the same count.

    >>> plan_step([3, 3, 3], 2, 6)
    [[[0, 2]], [[1]]]
    >>> plan_step([6, 1, 1, 4], 1, 8), plan_step([6, 1, 1, 4], 1, 8, packed=True)
    ([[[0], [3, 1], [2]]], [[[0, 1, 2], [3]]])
    """
    per_rank = []
    for idx in balance(lengths, world_size):
        if packed:
            per_rank.append(pack(idx, lengths, max_tokens))
            continue
        idx = sorted(idx, key=lambda i: -lengths[i])  # similar lengths together: less padding
        per_rank.append(micro_batches(idx, lengths, max_tokens))
    steps = max(1, max(len(m) for m in per_rank))
    return [m + [[] for _ in range(steps - len(m))] for m in per_rank]
