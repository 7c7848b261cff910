"""Rank 0's staging memory for pushes that do not broadcast: the shared-memory segment (a ready
table at offset 0, then the buckets) and the CUDA buffers shared over IPC (one per bucket).

Both are kept, sized to the plan, from one push to the next: rewriting them is safe only once
every replica that reads them has answered. ``renew`` forgets them after a push in which one did
not answer in time: the next push writes fresh memory, while that replica may still be reading
the old (the segment is unlinked, not unmapped under it; torch keeps a shared CUDA block alive
while another process holds it).
"""

from __future__ import annotations

from relayrl.common.weightsync.cudaipc import shared_to_proto
from relayrl.common.weightsync.plan import Bucket, aligned
from relayrl.common.weightsync.shm import ReadyTable, Segment


class Staging:
    def __init__(self, device: str):
        self.device = device  # the learner's, where IPC buffers live
        self._segment: Segment | None = None
        self._ipc: tuple[list, list] | None = None  # (CUDA buffers, their sharing fields)

    def shm(self, buckets: list[Bucket]) -> tuple[Segment, tuple[int, ...], ReadyTable]:
        """The segment, each bucket's offset in it, and its ready table."""
        offsets, end = [], aligned(len(buckets) * ReadyTable.ENTRY)
        for b in buckets:
            offsets.append(end)
            end = aligned(end + b.nbytes)
        if self._segment is None or self._segment.size != end:
            if self._segment is not None:
                self._segment.close()
            self._segment = Segment.create(end)
        return self._segment, tuple(offsets), ReadyTable(self._segment, 0, len(buckets))

    def ipc(self, buckets: list[Bucket]) -> tuple[list, list]:
        """One CUDA buffer per bucket, and the fields that share each."""
        import torch
        from relayrl.common.weightsync.cudaipc import share

        sizes = [b.nbytes for b in buckets]
        if self._ipc is None or [t.numel() for t in self._ipc[0]] != sizes:
            bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self._ipc = (bufs, [shared_to_proto(share(t)) for t in bufs])
        return self._ipc

    def renew(self) -> None:
        """The next push stages into fresh memory (a reader of this push may not be done)."""
        self.close()

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._ipc = None
