"""The learner's side of a shared-memory push, for tests of a generator replica: the probe that
opens the weight sync (``open_shm``), and a segment holding a ready table and the buckets
(``Staging``), from which ``UpdateWeights`` requests are built."""

from __future__ import annotations

import torch
from relayrl.common.weightsync.buckets import checksum, pack
from relayrl.common.weightsync.plan import Bucket, aligned, plan_to_proto
from relayrl.common.weightsync.shm import ReadyTable, Segment
from relayrl.generator.v1 import generator_pb2 as g


class Staging:
    """The learner's shared-memory side: a segment holding a ready table, then the buckets."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.offsets, end = [], aligned(len(buckets) * ReadyTable.ENTRY)
        for b in buckets:
            self.offsets.append(end)
            end = aligned(end + b.nbytes)
        self.seg = Segment.create(end, "t")
        self.table = ReadyTable(self.seg, 0, len(buckets))

    def fill(self, tensors: dict[str, torch.Tensor], push_id: int, upto: int | None = None) -> list[int]:
        sums = []
        for i, (b, o) in enumerate(zip(self.buckets, self.offsets, strict=True)):
            if upto is not None and i >= upto:
                break
            buf = pack(b, [tensors[m.name] for m in b.tensors], out=self.seg.view()[o : o + b.nbytes])
            sums.append(checksum(buf))
            self.table.mark(i, push_id, sums[-1])
        return sums

    def request(self, version: int, push: int, **shm) -> g.UpdateWeightsRequest:
        """UpdateWeights naming this segment; ``shm`` replaces fields of its ``shm`` source."""
        fields = {
            "segment": self.seg.name,
            "offsets": self.offsets,
            "push_id": push,
            "ready_offset": 0,
            **shm,
        }
        return g.UpdateWeightsRequest(
            version=version, plan=plan_to_proto(self.buckets), shm=g.SharedMemoryBuckets(**fields)
        )


async def open_shm(stub, timeout_s: float = 30.0) -> None:
    """InitWeightSync over shared memory, its probe written and checked as the learner does."""
    probe = Segment.create(64, "t")
    try:
        probe.write(0, (1234).to_bytes(8, "little"))
        await stub.InitWeightSync(
            g.InitWeightSyncRequest(
                transport=g.WEIGHT_TRANSPORT_SHM,
                shm_probe=probe.name,
                probe_checksum=1234,
                timeout_seconds=timeout_s,
            )
        )
    finally:
        probe.close()
