"""Rank 0's side of one push: each bucket, once gathered, is packed once where a transport needs it
and handed to every transport the replicas use.

``Sinks`` says where: broadcast groups (gloo, NCCL), the staging memory of a shared-memory segment
and of CUDA buffers shared over IPC (``buckets.Staging``: one buffer, a view per bucket). The first
sink in the order IPC, shared memory, group takes the packed bytes (one batched copy per bucket);
the others get a copy on their own device. Each bucket's checksum is computed where it was packed
and the checksums are read back once, at the end (``buckets.Sums``); only a shared-memory ready
mark, which carries its bucket's checksum, reads one as it goes. A bucket is marked ready for IPC
readers once its copy is complete on the GPU (an event waited for one bucket late, so the GPU
never waits for the host): they read it while later buckets are packed. The broadcast of bucket
i runs while bucket i+1 is gathered. A failed broadcast (a generator died) does not stop the
loop, since the other ranks gather bucket after bucket in step with this one; it is reported at
the end, training unharmed. The groups are abandoned at the first failure, so the generators
still waiting for a bucket stop within a second instead of at the group's timeout (minutes), and
can join the next group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from relayrl.common.rpc import Unavailable
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.buckets import Staging, Sums, pack
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
    shm: Staging | None = None  # the segment's buckets
    on_ready: Callable[[int, int], None] | None = None  # (bucket index, checksum) once it is in shm
    ipc: Staging | None = None  # the shared CUDA buffer's buckets
    on_ipc_ready: Callable[[int], None] | None = None  # bucket index, once complete on the GPU

    def __bool__(self) -> bool:
        return bool(self.groups) or self.shm is not None or self.ipc is not None


def send_buckets(
    buckets: list[Bucket], items: Iterable[list[torch.Tensor] | torch.Tensor | None], sinks: Sinks
) -> tuple[int, list[int]]:
    """Pack and send each bucket: ``items`` gives per bucket its gathered tensors (or an already
    packed uint8 buffer; None on ranks that only gather). Returns bytes sent and checksums."""
    sent, sums, error = 0, Sums(), None
    in_flight: list = []  # (work, buffer) of the previous bucket's broadcasts
    unmarked: list = []  # (bucket index, event) staged for IPC, not yet marked ready
    for i, (b, item) in enumerate(zip(buckets, items, strict=True)):
        if item is None or not sinks or error is not None:
            continue
        try:
            buf = _stage(i, b, item, sinks)
            sums.add(buf)
            if sinks.ipc is not None and sinks.on_ipc_ready is not None:
                ev = _event(buf)
                unmarked.append((i, ev))
                # On a GPU the previous bucket, once its copy is done; on the CPU this one.
                _mark_ipc(sinks, unmarked, keep=0 if ev is None else 1)
            if sinks.shm is not None:
                if buf.device.type != "cpu":  # staged on a GPU for IPC
                    sinks.shm.views[i].copy_(buf)
                if sinks.on_ready is not None:
                    sinks.on_ready(i, sums.value(len(sums) - 1))
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
            _mark_ipc(sinks, unmarked, keep=0)
            for work, _ in in_flight:
                work.wait()
        except RuntimeError as e:
            error = e
            for g in sinks.groups:
                g.close(abandon=True)
    if error is not None:
        raise Unavailable(f"weight broadcast failed after {sent} bytes: {error}")
    return sent, sums.read()


def _event(buf: torch.Tensor):
    """An event recorded after the work queued so far on ``buf``'s GPU (None on the CPU: a CPU
    copy is complete when it returns)."""
    if buf.device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(buf.device))
    return ev


def _mark_ipc(sinks: Sinks, unmarked: list, keep: int) -> None:
    """Mark ready every staged IPC bucket but the last ``keep``, each once its copy is done."""
    while len(unmarked) > keep:
        i, ev = unmarked.pop(0)
        if ev is not None:
            ev.synchronize()
        sinks.on_ipc_ready(i)


def _stage(i: int, b: Bucket, item: list[torch.Tensor] | torch.Tensor, sinks: Sinks) -> torch.Tensor:
    """The bucket packed into the first sink that holds memory of its own, else a fresh buffer
    on the first group's device (or a view of a lone tensor already there)."""
    staging = sinks.ipc if sinks.ipc is not None else sinks.shm
    if isinstance(item, torch.Tensor):  # packed already (transport-only pushes: zeros)
        if staging is None:
            return item.to(sinks.groups[0].device)
        return staging.views[i].copy_(item)
    if staging is None:
        return pack(b, item, device=sinks.groups[0].device)
    return staging.fill(i, item)


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
