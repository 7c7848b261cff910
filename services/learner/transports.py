"""Rank 0's side of each weight transport: one class per kind, one interface.

``WeightSync`` (``sync.py``) keeps one instance per kind (``make``) for all the replicas that use
it, and knows nothing of how a kind works beyond this interface:

* ``open(rid)``: make the transport work with replica ``rid`` now (at its registration, or when
  it lost its sync). A group transport (gloo, NCCL) forms its group anew with every member in it
  (``groupform``); shared memory and CUDA IPC have the replica read a probe the learner made. A
  transport that cannot work raises here, never at a push.
* ``stage(plan, base)``: prepare one push: the ``UpdateWeights`` its members get (``base``, the
  plan's request, plus where the buckets will be) and where the gather + send writes the buckets
  (the ``Sinks`` it fills: a group to broadcast on, the segment and its ready table, the CUDA
  buffers).
* ``abort()``: give the push up: members still waiting for a bucket stop at once (the ready table
  marks the push given up; a group's store marks it abandoned).
* ``leave(rid)``: a member failed or went away: a group is closed (it re-forms without it at the
  next push); staging memory stays.
* ``renew()``: a member did not answer and may still read this push's memory: the next push
  stages into fresh memory. ``close()``: the learner is stopping.

``GROUP`` says whether the kind broadcasts over a group: every member takes part in each
broadcast (one that holds the pushed version already drains it). Members of every kind are called
before the learner sends (``EARLY``): group members receive each broadcast, shared-memory and
IPC members load each bucket as the push's ready table marks it complete.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Protocol

import grpc
from relayrl.common.rpc import Unavailable
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.buckets import Staging
from relayrl.common.weightsync.cudaipc import share, shared_to_proto, window
from relayrl.common.weightsync.group import master_store
from relayrl.common.weightsync.plan import Bucket, aligned, layout
from relayrl.common.weightsync.shm import ReadyTable, Segment
from relayrl.common.weightsync.transports import GROUP_BACKEND
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner import groupform
from relayrl.learner.push import Sinks, WeightGroup

logger = logging.getLogger(__name__)

ENUM = {
    "gloo": g.WEIGHT_TRANSPORT_GLOO,
    "nccl": g.WEIGHT_TRANSPORT_NCCL,
    "shm": g.WEIGHT_TRANSPORT_SHM,
    "ipc": g.WEIGHT_TRANSPORT_IPC,
}


class Peers(Protocol):
    """What a transport needs of ``WeightSync``: where rank 0 runs, the replicas, their stubs."""

    host: str
    device: str
    timeout_s: float
    control_s: float
    addresses: dict[str, str]
    transports: dict[str, str]

    def stub(self, rid: str) -> gg.GeneratorServiceStub: ...
    async def close_syncs(self, rids: list[str]) -> None: ...


def why(e: BaseException) -> str:
    """A failure as one line: a status code and its details, or the exception."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return f"{type(e).__name__}: {e}"


class Transport:
    """The interface (see the module docstring); what a kind does not need is a no-op."""

    GROUP = False  # broadcasts over a group: every member takes part (a current one drains)
    EARLY = True  # members are called before the learner sends (they read while it writes)

    def __init__(self, name: str, peers: Peers):
        self.name, self.peers = name, peers

    async def open(self, rid: str) -> None:
        raise NotImplementedError

    async def stage(
        self, buckets: list[Bucket], base: g.UpdateWeightsRequest, sinks: Sinks
    ) -> g.UpdateWeightsRequest:
        raise NotImplementedError

    def abort(self) -> None:
        pass

    async def leave(self, rid: str) -> None:
        pass

    def renew(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def _probe(self, rid: str, value: int, **fields) -> None:
        """InitWeightSync naming the probe (``fields``) that holds ``value``."""
        req = g.InitWeightSyncRequest(
            transport=ENUM[self.name], probe_checksum=value, timeout_seconds=self.peers.timeout_s, **fields
        )
        await self.peers.stub(rid).InitWeightSync(req, timeout=self.peers.timeout_s)


class GroupTransport(Transport):
    """gloo or NCCL: a private process group, rank 0 this learner, formed with exactly its members."""

    GROUP = True

    def __init__(self, name: str, peers: Peers):
        super().__init__(name, peers)
        self.backend = GROUP_BACKEND[name]
        self.group: WeightGroup | None = None

    def holds(self, rid: str) -> bool:
        """Whether ``rid`` is a member of the group open now."""
        return self.group is not None and rid in self.group.members

    async def open(self, rid: str) -> None:
        await self.ensure()

    async def stage(
        self, buckets: list[Bucket], base: g.UpdateWeightsRequest, sinks: Sinks
    ) -> g.UpdateWeightsRequest:
        sinks.groups.append(await self.ensure())
        return base

    def abort(self) -> None:
        if self.group is not None and self.group.store is not None:
            groupwait.abandon(self.group.store)

    async def leave(self, rid: str) -> None:
        await self.close_group()  # it re-forms without ``rid`` at the next push

    async def close_group(self, abandon: bool = False) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        # The learner's side first: after a push that broke (``abandon``) the members still
        # waiting for a bucket stop and can answer CloseWeightSync (they would wait out the
        # group's timeout otherwise).
        await asyncio.to_thread(group.close, abandon)
        await self.peers.close_syncs([r for r in group.members if r in self.peers.addresses])

    async def ensure(self) -> WeightGroup:
        """The group, formed anew unless its members are exactly the replicas of this kind."""
        peers = self.peers
        wanted = {r for r, t in peers.transports.items() if t == self.name}
        if self.group is not None and set(self.group.members) == wanted:
            return self.group
        await self.close_group()
        if self.backend == "nccl" and not peers.device.startswith("cuda"):
            raise RuntimeError("nccl needs the learner on a GPU")
        rids = sorted(wanted)
        # Whatever a member may still hold open (a formation that failed after it had joined,
        # a close whose caller was cancelled) is closed first: it would refuse to join otherwise.
        await peers.close_syncs(rids)
        statuses = await asyncio.gather(
            *(peers.stub(r).GetStatus(g.GetStatusRequest(), timeout=peers.control_s) for r in rids),
            return_exceptions=True,
        )
        ranks, nxt = {}, 1
        for r, st in zip(rids, statuses, strict=True):
            if isinstance(st, BaseException):
                raise Unavailable(f"generator {r} at {peers.addresses[r]} is unreachable: {why(st)}")
            ranks[r] = nxt
            nxt += max(1, st.weight_sync_ranks)
        store = master_store(peers.host, nxt, peers.timeout_s)  # listening: its port is ours
        port = store.port
        joined = groupform.join_in_thread(peers.host, port, nxt, self.backend, peers.timeout_s, store=store)
        calls = {
            r: asyncio.ensure_future(
                peers.stub(r).InitWeightSync(
                    g.InitWeightSyncRequest(
                        transport=ENUM[self.name],
                        master_addr=peers.host,
                        master_port=port,
                        world_size=nxt,
                        rank=ranks[r],
                        timeout_seconds=peers.timeout_s,
                    ),
                    timeout=peers.timeout_s,
                )
            )
            for r in rids
        }
        spans = {
            r: range(ranks[r], ranks[r] + max(1, st.weight_sync_ranks))
            for r, st in zip(rids, statuses, strict=True)
        }
        where = (peers.host, port, nxt, peers.timeout_s)
        pg, store = await groupform.form(joined, calls, spans, where, self.backend, why)
        device = peers.device if self.backend == "nccl" else "cpu"
        self.group = WeightGroup(
            pg=pg, members=ranks, world_size=nxt, device=device, store=store, timeout_s=peers.timeout_s
        )
        logger.info("%s weight-sync group formed: %s (world %d)", self.backend, ranks, nxt)
        return self.group


class ShmTransport(Transport):
    """One shared-memory segment on this host: a ready table at offset 0, then the buckets
    (``buckets.Staging`` over the mapping). Kept, sized to the plan, from one push to the next
    (rewritten only once every reader has answered: ``renew`` otherwise)."""

    def __init__(self, name: str, peers: Peers):
        super().__init__(name, peers)
        self._segment: Segment | None = None
        self._staging: Staging | None = None
        self._push_id = 0  # pushes through the segment so far (marks in its ready table)
        self._abort = lambda: None

    async def open(self, rid: str) -> None:
        value = int.from_bytes(secrets.token_bytes(8), "little")
        seg = Segment.create(64, "probe")
        try:
            seg.write(0, value.to_bytes(8, "little"))
            await self._probe(rid, value, shm_probe=seg.name)
        finally:
            seg.close()

    async def stage(
        self, buckets: list[Bucket], base: g.UpdateWeightsRequest, sinks: Sinks
    ) -> g.UpdateWeightsRequest:
        start = len(buckets) * ReadyTable.ENTRY
        offsets, end = layout(buckets, start)
        if self._segment is None or self._segment.size != end:
            self.close()
            self._segment = Segment.create(end)
        seg, table = self._segment, ReadyTable(self._segment, 0, len(buckets))
        if self._staging is None or self._staging.buckets != buckets:
            self._staging = Staging(buckets, buf=seg.view(), start=start)
        self._push_id += 1
        push_id = self._push_id
        sinks.shm = self._staging
        sinks.on_ready = lambda i, checksum: table.mark(i, push_id, checksum)
        self._abort = lambda: table.abort(push_id)
        req = g.UpdateWeightsRequest()
        req.CopyFrom(base)
        req.shm.segment, req.shm.offsets[:] = seg.name, offsets
        req.shm.push_id, req.shm.ready_offset = push_id, 0
        return req

    def abort(self) -> None:
        self._abort()  # readers see the push given up at once

    def renew(self) -> None:
        self.close()  # unlinked, not unmapped under a reader that may still be at it

    def close(self) -> None:
        self._staging = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None


class IpcTransport(Transport):
    """One CUDA buffer on the learner's GPU holding every bucket (``buckets.Staging``), shared
    over IPC once; a replica gets a window of it per bucket (``cudaipc.window``). Beside it, a
    small shared-memory segment holds the push's ready table: a bucket is marked once its copy
    is complete on the GPU, and the replicas, called before the learner sends, read each bucket
    as it is marked. Kept, sized to the plan, from one push to the next. ``renew`` (a replica
    silent, perhaps still reading) stages the next push into fresh memory and keeps the old
    buffer for the sync timeout before freeing it: torch's own count of the processes holding a
    shared block is not to be relied on here (it is set once per share and taken down once per
    storage a receiver opens, a window per bucket and push)."""

    def __init__(self, name: str, peers: Peers):
        super().__init__(name, peers)
        # (staging, each bucket's sharing fields, the ready table's segment)
        self._ipc: tuple[Staging, list, Segment] | None = None
        self._push_id = 0
        self._abort = lambda: None

    async def open(self, rid: str) -> None:
        import torch

        if not self.peers.device.startswith("cuda"):
            raise RuntimeError("the learner trains on the CPU: no GPU to share")
        value = int.from_bytes(secrets.token_bytes(8), "little")
        buf = torch.frombuffer(bytearray(value.to_bytes(8, "little")), dtype=torch.uint8).to(
            self.peers.device
        )
        await self._probe(rid, value, ipc_probe=shared_to_proto(share(buf)))
        del buf  # the replica has read it: the answer says so

    async def stage(
        self, buckets: list[Bucket], base: g.UpdateWeightsRequest, sinks: Sinks
    ) -> g.UpdateWeightsRequest:
        if self._ipc is None or self._ipc[0].buckets != buckets:
            self.close()
            staging = Staging(buckets, device=self.peers.device)
            whole = share(staging.buf)
            fields = [
                shared_to_proto(window(whole, off, b.nbytes))
                for b, off in zip(buckets, staging.offsets, strict=True)
            ]
            ready = Segment.create(aligned(max(1, len(buckets)) * ReadyTable.ENTRY), "ready")
            self._ipc = (staging, fields, ready)
        staging, fields, seg = self._ipc
        table = ReadyTable(seg, 0, len(buckets))
        self._push_id += 1
        push_id = self._push_id
        sinks.ipc = staging
        sinks.on_ipc_ready = lambda i: table.mark(i, push_id, 0)
        self._abort = lambda: table.abort(push_id)
        req = g.UpdateWeightsRequest()
        req.CopyFrom(base)
        req.ipc.buffers.extend(fields)
        req.ipc.push_id, req.ipc.ready_segment = push_id, seg.name
        return req

    def abort(self) -> None:
        self._abort()  # readers see the push given up at once

    def renew(self) -> None:
        held = self._ipc
        self.close()
        if held is not None:
            groupwait.retire([held], self.peers.timeout_s)

    def close(self) -> None:
        if self._ipc is not None:
            self._ipc[2].close()  # unlinked; a reader still at it keeps its descriptor
            self._ipc = None


def make(peers: Peers) -> dict[str, Transport]:
    """One instance of every kind, by name."""
    return {
        "gloo": GroupTransport("gloo", peers),
        "nccl": GroupTransport("nccl", peers),
        "shm": ShmTransport("shm", peers),
        "ipc": IpcTransport("ipc", peers),
    }
