"""Rank 0's side of one push: each bucket, once gathered, is packed once where a transport needs it
and handed to every transport the replicas use.

``Sinks`` says where: broadcast groups (gloo, NCCL), a shared-memory segment (its view and each
bucket's offset) and CUDA buffers shared over IPC (one per bucket). The first sink in the order
IPC, shared memory, group takes the packed bytes; the others get a copy on their own device.
The broadcast of bucket i runs while bucket i+1 is gathered. A failed broadcast (a generator
died) does not stop the loop, since the other ranks gather bucket after bucket in step with
this one; it is reported at the end, training unharmed. The groups are abandoned at the first
failure, so the generators still waiting for a bucket stop within a second instead of at the
group's timeout (minutes), and can join the next group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from relayrl.common.rpc import Unavailable
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.buckets import checksum, pack
from relayrl.common.weightsync.plan import Bucket


@dataclass
class WeightGroup:
    """An open weight-sync group: rank 0 of it is this learner's rank 0."""

    pg: object
    members: dict[str, int]  # replica_id -> first rank
    world_size: int
    device: str = "cpu"  # where its buffers live: "cpu" for gloo, the learner's GPU for NCCL
    store: object = None  # the group's store, hosted by this rank: the abandon mark goes there
    timeout_s: float = 300.0  # the group's own timeout: how long pending work may last

    def close(self, abandon: bool = False) -> None:
        """Leave the group; with ``abandon`` (a push broke) first tell the members still waiting
        for a bucket to stop (``groupwait``). The group itself is dropped once its timeout has
        passed (``groupwait.retire``: pending work would freeze the process). NCCL is aborted."""
        if abandon and self.store is not None:
            groupwait.abandon(self.store)
        holder, self.pg, self.store = [self.pg], None, None
        if holder[0] is not None:
            groupwait.release(holder, self.device != "cpu", self.timeout_s + 5)


@dataclass
class Sinks:
    """Where the buckets of a push go (see the module docstring)."""

    groups: list[WeightGroup] = field(default_factory=list)
    shm: torch.Tensor | None = None
    shm_offsets: tuple[int, ...] = ()
    ipc: list[torch.Tensor] | None = None
    on_ready: Callable[[int, int], None] | None = None  # (bucket index, checksum) once it is in shm

    def __bool__(self) -> bool:
        return bool(self.groups) or self.shm is not None or bool(self.ipc)


def send_buckets(
    buckets: list[Bucket], items: Iterable[list[torch.Tensor] | torch.Tensor | None], sinks: Sinks
) -> tuple[int, list[int]]:
    """Pack and send each bucket: ``items`` gives per bucket its gathered tensors (or an already
    packed uint8 buffer; None on ranks that only gather). Returns bytes sent and checksums."""
    sent, sums, error = 0, [], None
    in_flight: list = []  # (work, buffer) of the previous bucket's broadcasts
    for i, (b, item) in enumerate(zip(buckets, items, strict=True)):
        if item is None or not sinks or error is not None:
            continue
        try:
            buf = _stage(i, b, item, sinks)
            sums.append(checksum(buf))
            if sinks.shm is not None and buf.device.type != "cpu":  # staged on a GPU for IPC
                _at(sinks, i, b).copy_(buf)
            if sinks.on_ready is not None:
                sinks.on_ready(i, sums[-1])
            works = []
            for g in sinks.groups:
                gbuf = buf if buf.device == torch.device(g.device) else buf.to(g.device)
                works.append((g.pg.broadcast(gbuf, 0), gbuf))
            for work, _ in in_flight:
                work.wait()
            in_flight = works
            if isinstance(item, list) and buf.data_ptr() == item[0].data_ptr():
                # A view of the gathered parameter (no copy): it is released when the gather
                # context closes, so its broadcasts must finish first.
                for work, _ in in_flight:
                    work.wait()
                in_flight = []
            sent += b.nbytes
        except RuntimeError as e:
            error = e
            for g in sinks.groups:
                g.close(abandon=True)
    if error is None:
        try:
            for work, _ in in_flight:
                work.wait()
        except RuntimeError as e:
            error = e
            for g in sinks.groups:
                g.close(abandon=True)
    if error is not None:
        raise Unavailable(f"weight broadcast failed after {sent} bytes: {error}")
    return sent, sums


def _at(sinks: Sinks, i: int, b: Bucket) -> torch.Tensor:
    off = sinks.shm_offsets[i]
    return sinks.shm[off : off + b.nbytes]


def _stage(i: int, b: Bucket, item: list[torch.Tensor] | torch.Tensor, sinks: Sinks) -> torch.Tensor:
    """The bucket packed into the first sink that holds memory of its own, else a fresh buffer
    on the first group's device (or a view of a lone tensor already there)."""
    out = sinks.ipc[i] if sinks.ipc else (_at(sinks, i, b) if sinks.shm is not None else None)
    if isinstance(item, torch.Tensor):  # packed already (transport-only pushes: zeros)
        if out is None:
            return item.to(sinks.groups[0].device)
        out.copy_(item)
        return out
    if out is None:
        return pack(b, item, device=sinks.groups[0].device)
    return pack(b, item, out=out)


async def answers(
    calls: dict[str, asyncio.Future],
    version: int,
    sums: list[int],
    current: set[str],
    transport_only: bool,
    timeout_s: float,
) -> tuple[dict[str, BaseException | str], dict[str, str], dict[str, int]]:
    """The replicas' answers to one push, checked against what was sent: each must carry the
    version pushed and, per bucket, the checksum of what was sent. The learner's part is over, so
    a replica only has its loading left: one silent for ``timeout_s`` is given up (its call
    cancelled). Returns the failed (an error, or why as a string), the corrupted (why) and the
    versions the others now hold."""
    if calls:
        await asyncio.wait(calls.values(), timeout=timeout_s)
    failed: dict[str, BaseException | str] = {}
    corrupted: dict[str, str] = {}
    loaded: dict[str, int] = {}
    for r in sorted(calls):
        c = calls[r]
        if not c.done():
            c.cancel()
            failed[r] = f"no answer within {timeout_s:g} s of the last bucket (weight_sync_timeout_seconds)"
            continue
        a = c.exception() if not c.cancelled() else asyncio.CancelledError("cancelled")
        if a is not None:
            failed[r] = a
            continue
        a = c.result()
        if list(a.bucket_checksums) != sums:
            corrupted[r] = "bucket checksums differ from what was sent"
        elif not transport_only and a.version != version:
            corrupted[r] = f"it answered version {a.version}, not {version}"
        elif not transport_only and r not in current:
            loaded[r] = a.version
    return failed, corrupted, loaded
