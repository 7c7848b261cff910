"""Rank 0's side of weight sync: registered generators, the transport of each, one push.

Registration picks a replica's transport from where both run (``transports.choose``: CUDA IPC on
the learner's GPU, shared memory on its host, NCCL to other GPUs, gloo across CPU hosts) or the
forced one, and opens it at once: a group transport forms its group with the replica in it, a
shared-memory or IPC transport has the replica open a probe the learner made. A transport that
cannot work is refused there with the reason (after trying the next one down in auto mode:
IPC -> shared memory, shared memory -> gloo), never at a push.

A push: every replica is asked its version (one that holds the pushed version already only
drains a broadcast: an earlier push that failed may have reached it), every group is formed with
exactly its members; group members get
``UpdateWeights(version, plan)``, shared-memory members ``UpdateWeights`` naming the segment and
its ready table, and the collective gather + send runs (``push.send_buckets``: broadcasts, the
bytes written into the segment and marked ready bucket by bucket, and into the IPC buffers);
then the IPC members get ``UpdateWeights`` naming the buffers. The staging
segment and buffers are reused at the next push only after every member answered. A member that
fails is dropped from its transport (its group re-forms without it) and the push reports
UNAVAILABLE naming it, after the others got the version.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable

import grpc
from relayrl.common import logcontext
from relayrl.common import weightsync as ws
from relayrl.common.placement import gpu_uuid, host_id
from relayrl.common.rpc import DataLoss, FailedPrecondition, ServiceError, Unavailable
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.common.shm import ReadyTable, Segment
from relayrl.common.tensors import plan_to_proto, shared_to_proto
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner.push import Sinks, WeightGroup
from relayrl.learner.transports import GROUP_BACKEND, Place, choose

logger = logging.getLogger(__name__)

_ENUM = {
    "gloo": g.WEIGHT_TRANSPORT_GLOO,
    "nccl": g.WEIGHT_TRANSPORT_NCCL,
    "shm": g.WEIGHT_TRANSPORT_SHM,
    "ipc": g.WEIGHT_TRANSPORT_IPC,
}
_FALLBACK = {"ipc": ["shm"], "shm": ["gloo"]}
"""Auto mode: what to try when the chosen transport's probe fails."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "", 0))
        return s.getsockname()[1]


class WeightSync:
    def __init__(
        self,
        host: str,
        device: str,
        dtype: str,
        timeout_s: float,
        deadline_s: float,
        metas: Callable[[str], list[ws.TensorMeta]],
        security: ClientSecurity | None = None,
        transport: str = "auto",
    ):
        self.host = host
        self.device = device  # the learner's: "cpu" or "cuda:<i>"
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._metas = metas
        self.security = security  # how rank 0 reaches the generators (TLS, token)
        self.forced = transport
        cuda = device.startswith("cuda")
        uuid = gpu_uuid(int(device.split(":")[1]) if ":" in device else 0) if cuda else ""
        self.place = Place(host_id(), "cuda" if cuda else "cpu", (uuid,) if uuid else ())
        self.addresses: dict[str, str] = {}
        self.transports: dict[str, str] = {}
        self.versions: dict[str, int] = {}
        self.groups: dict[str, WeightGroup] = {}
        self._segment: Segment | None = None
        self._ipc: tuple[list, list] | None = None  # (CUDA buffers, their sharing fields)
        self._push_id = 0  # pushes through the staging segment so far (marks in its ready table)
        self._channels: dict[str, grpc.aio.Channel] = {}

    # -- membership ------------------------------------------------------------------------
    async def register(self, replica_id: str, address: str) -> str:
        """Add a replica and open its transport now; returns the transport. A replica that
        registers again starts afresh (it is most likely a restarted process: its side of any
        weight-sync group is gone, and it serves the weights it loaded, not the last ones sent)."""
        if replica_id in self.addresses:
            await self.unregister(replica_id)
        self.addresses[replica_id] = address
        try:
            return await self._open(replica_id)
        except BaseException:
            await self.unregister(replica_id)
            raise

    async def unregister(self, replica_id: str) -> None:
        transport = self.transports.pop(replica_id, None)
        self.addresses.pop(replica_id, None)
        self.versions.pop(replica_id, None)
        if transport in GROUP_BACKEND:  # the group re-forms without it at the next push
            await self._close_group(GROUP_BACKEND[transport])
        ch = self._channels.pop(replica_id, None)
        if ch is not None:
            await ch.close()

    def replica_ids(self) -> list[str]:
        return sorted(self.addresses)

    def members(self) -> list[tuple[str, str, int, str]]:
        return [
            (r, self.addresses[r], self.versions.get(r, 0), self.transports.get(r, ""))
            for r in self.replica_ids()
        ]

    def _stub(self, replica_id: str) -> gg.GeneratorServiceStub:
        ch = self._channels.get(replica_id)
        if ch is None:
            ch = self._channels[replica_id] = client_channel(
                self.addresses[replica_id],
                self.security,
                options=[("grpc.max_send_message_length", 256 << 20)],
            )
        return gg.GeneratorServiceStub(ch)

    # -- opening a transport -----------------------------------------------------------------
    async def _open(self, rid: str) -> str:
        try:
            st = await self._stub(rid).GetStatus(g.GetStatusRequest(), timeout=30)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"generator {rid} at {self.addresses[rid]} is unreachable: {_why(e)}") from None
        theirs = Place(st.host_id or f"unknown:{rid}", st.device or "cpu", tuple(st.gpu_uuids))
        self.versions[rid] = st.policy_version  # what it serves now: a push of that version skips it
        first = choose(self.place, theirs, self.forced)
        reasons = []
        for transport in [first, *(_FALLBACK.get(first, []) if self.forced == "auto" else [])]:
            try:
                await self._stub(rid).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=30)
                self.transports[rid] = transport
                if transport in GROUP_BACKEND:
                    await self._ensure_group(GROUP_BACKEND[transport])
                else:
                    await self._probe(rid, transport)
                logger.info("generator %s: weight transport %s", rid, transport)
                return transport
            except (ServiceError, grpc.aio.AioRpcError, OSError, RuntimeError, ValueError) as e:
                self.transports.pop(rid, None)
                reasons.append(f"{transport}: {_why(e)}")
        raise FailedPrecondition(f"no weight transport reaches generator {rid}: " + "; ".join(reasons))

    async def _probe(self, rid: str, transport: str) -> None:
        """Make a probe the replica must read over ``transport`` (the learner's side of it)."""
        value = int.from_bytes(secrets.token_bytes(8), "little")
        req = g.InitWeightSyncRequest(
            transport=_ENUM[transport], probe_checksum=value, timeout_seconds=self.timeout_s
        )
        if transport == "shm":
            seg = Segment.create(64, "probe")
            try:
                seg.write(0, value.to_bytes(8, "little"))
                req.shm_probe = seg.name
                await self._stub(rid).InitWeightSync(req, timeout=self.timeout_s)
            finally:
                seg.close()
        else:
            import torch
            from relayrl.common.cudaipc import share

            if not self.device.startswith("cuda"):
                raise RuntimeError("the learner trains on the CPU: no GPU to share")
            buf = torch.frombuffer(bytearray(value.to_bytes(8, "little")), dtype=torch.uint8).to(self.device)
            req.ipc_probe.CopyFrom(shared_to_proto(share(buf)))
            await self._stub(rid).InitWeightSync(req, timeout=self.timeout_s)
            del buf  # the replica has read it: the answer says so

    async def _close_group(self, backend: str, abandon: bool = False) -> None:
        group = self.groups.pop(backend, None)
        if group is None:
            return
        # The learner's side first: after a push that broke (``abandon``) the members still
        # waiting for a bucket stop and can answer CloseWeightSync (they would wait out the
        # group's timeout otherwise).
        await asyncio.to_thread(group.close, abandon)
        for rid in group.members:
            if rid in self.addresses:
                try:
                    await self._stub(rid).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=30)
                except grpc.RpcError as e:
                    logger.warning("CloseWeightSync on %s failed: %s", rid, _why(e))

    async def _ensure_group(self, backend: str) -> WeightGroup:
        wanted = {r for r, t in self.transports.items() if GROUP_BACKEND.get(t) == backend}
        group = self.groups.get(backend)
        if group is not None and set(group.members) == wanted:
            return group
        await self._close_group(backend)
        if backend == "nccl" and not self.device.startswith("cuda"):
            raise RuntimeError("nccl needs the learner on a GPU")
        rids = sorted(wanted)
        statuses = await asyncio.gather(
            *(self._stub(r).GetStatus(g.GetStatusRequest(), timeout=30) for r in rids), return_exceptions=True
        )
        ranks, nxt = {}, 1
        for r, st in zip(rids, statuses, strict=True):
            if isinstance(st, BaseException):
                raise Unavailable(f"generator {r} at {self.addresses[r]} is unreachable: {_why(st)}")
            ranks[r] = nxt
            nxt += max(1, st.weight_sync_ranks)
        port = free_port(self.host)
        calls = [
            asyncio.ensure_future(
                self._stub(r).InitWeightSync(
                    g.InitWeightSyncRequest(
                        transport=_ENUM[backend],
                        master_addr=self.host,
                        master_port=port,
                        world_size=nxt,
                        rank=ranks[r],
                        timeout_seconds=self.timeout_s,
                    ),
                    timeout=self.timeout_s,
                )
            )
            for r in rids
        ]
        try:
            pg, store = await asyncio.to_thread(
                ws.open_group_with_store, self.host, port, nxt, 0, backend, self.timeout_s
            )
        except Exception as e:
            for c in calls:
                c.cancel()
            raise Unavailable(f"{backend} weight-sync group did not form: {e}") from None
        answers = await asyncio.gather(*calls, return_exceptions=True)
        bad = [f"{r}: {_why(a)}" for r, a in zip(rids, answers, strict=True) if isinstance(a, BaseException)]
        if bad:
            pg.shutdown()
            raise Unavailable(f"generators failed to join the {backend} weight-sync group: " + "; ".join(bad))
        device = self.device if backend == "nccl" else "cpu"
        self.groups[backend] = WeightGroup(
            pg=pg, members=ranks, world_size=nxt, device=device, store=store, timeout_s=self.timeout_s
        )
        logger.info("%s weight-sync group formed: %s (world %d)", backend, ranks, nxt)
        return self.groups[backend]

    async def _refresh_versions(self) -> None:
        """Each replica's version as it says now. A push that failed may still have reached some
        (a broadcast completes on one member before it fails on another, and their answers are
        cancelled), and a restarted replica holds its initial weights: what was recorded at the
        last push is not enough to tell who must load and who must only drain. An unreachable
        replica keeps its record (the push fails on it anyway)."""
        rids = sorted(self.addresses)
        statuses = await asyncio.gather(
            *(self._stub(r).GetStatus(g.GetStatusRequest(), timeout=30) for r in rids), return_exceptions=True
        )
        for r, st in zip(rids, statuses, strict=True):
            if not isinstance(st, BaseException):
                self.versions[r] = st.policy_version

    # -- staging -----------------------------------------------------------------------------
    def _shm_staging(self, buckets: list[ws.Bucket]) -> tuple[Segment, tuple[int, ...], ReadyTable]:
        """The staging segment: the ready table at offset 0, then the buckets."""
        offsets, end = [], ws.aligned(len(buckets) * ReadyTable.ENTRY)
        for b in buckets:
            offsets.append(end)
            end = ws.aligned(end + b.nbytes)
        if self._segment is None or self._segment.size != end:
            if self._segment is not None:
                self._segment.close()
            self._segment = Segment.create(end)
        return self._segment, tuple(offsets), ReadyTable(self._segment, 0, len(buckets))

    def _ipc_staging(self, buckets: list[ws.Bucket]) -> tuple[list, list]:
        import torch
        from relayrl.common.cudaipc import share

        sizes = [b.nbytes for b in buckets]
        if self._ipc is None or [t.numel() for t in self._ipc[0]] != sizes:
            bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self._ipc = (bufs, [shared_to_proto(share(t)) for t in bufs])
        return self._ipc

    def close(self) -> None:
        """Free the staging memory (the learner is stopping)."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._ipc = None

    # -- a push ------------------------------------------------------------------------------
    async def push(
        self,
        version: int,
        bucket_bytes: int,
        collective: Callable[[Sinks], Awaitable[tuple[int, list[int]]]],
        transport_only: bool = False,
    ) -> tuple[int, list[str]]:
        if not self.addresses:
            return 0, []
        await self._refresh_versions()
        if not transport_only and all(self.versions.get(r) == version for r in self.addresses):
            return 0, sorted(self.addresses)  # all current: idempotent by version
        for backend in sorted({GROUP_BACKEND[t] for t in self.transports.values() if t in GROUP_BACKEND}):
            await self._ensure_group(backend)
        buckets = ws.plan_buckets(self._metas(self.dtype), bucket_bytes)
        base = g.UpdateWeightsRequest(
            version=version, plan=plan_to_proto(buckets), transport_only=transport_only
        )
        sinks = Sinks(groups=[self.groups[b] for b in sorted(self.groups)])
        # Replicas at `version` already (one came back and the others are current): a group's
        # members all take part in its broadcast, so the current ones drain it and keep their
        # weights (transport_only); over SHM or IPC they are not called at all.
        current = set() if transport_only else {r for r in self.addresses if self.versions.get(r) == version}
        drain = g.UpdateWeightsRequest()
        drain.CopyFrom(base)
        drain.transport_only = True
        requests = {
            r: drain if r in current else base for r, t in self.transports.items() if t in GROUP_BACKEND
        }
        table = None
        if any(t == "shm" for t in self.transports.values()):
            seg, offsets, table = self._shm_staging(buckets)
            self._push_id += 1
            push_id = self._push_id
            sinks.shm, sinks.shm_offsets = seg.view(writable=True), offsets
            sinks.on_ready = lambda i, checksum: table.mark(i, push_id, checksum)
            req = g.UpdateWeightsRequest()
            req.CopyFrom(base)
            req.shm.segment, req.shm.offsets[:] = seg.name, offsets
            req.shm.push_id, req.shm.ready_offset = push_id, 0
            requests.update({r: req for r, t in self.transports.items() if t == "shm" and r not in current})
        if any(t == "ipc" for t in self.transports.values()):
            bufs, shared = self._ipc_staging(buckets)
            sinks.ipc = bufs
            req = g.UpdateWeightsRequest()
            req.CopyFrom(base)
            req.ipc.buffers.extend(shared)
            requests.update({r: req for r, t in self.transports.items() if t == "ipc" and r not in current})
        with logcontext.bound(version=version):
            meta = logcontext.current()

        def call(r: str) -> asyncio.Future:
            return asyncio.ensure_future(
                self._stub(r).UpdateWeights(requests[r], timeout=self.deadline_s, metadata=meta)
            )

        # Group members receive while the learner sends; shared-memory replicas load each bucket
        # as the ready table marks it, while the learner gathers the next.
        early = sorted(
            r for r, t in self.transports.items() if r in requests and t in (*GROUP_BACKEND, "shm")
        )
        calls = {r: call(r) for r in early}
        try:
            sent, sums = await collective(sinks)
        except Exception:
            if table is not None:
                table.abort(push_id)  # shared-memory readers stop waiting at once
            for c in calls.values():
                c.cancel()
            for backend in list(self.groups):
                await self._close_group(backend, abandon=True)
            raise
        calls.update({r: call(r) for r in sorted(requests) if r not in calls})  # IPC: the buffers are filled
        rids = sorted(calls)
        answers = await asyncio.gather(*(calls[r] for r in rids), return_exceptions=True)
        failed, corrupted = {}, []
        for r, a in zip(rids, answers, strict=True):
            if isinstance(a, BaseException):
                failed[r] = _why(a)
            elif list(a.bucket_checksums) != sums:
                corrupted.append(r)
            elif not transport_only and r not in current:
                self.versions[r] = a.version
        for r in [*failed, *corrupted]:
            transport = self.transports.get(r)
            if transport in GROUP_BACKEND:  # its group re-forms at the next push
                await self._close_group(GROUP_BACKEND[transport])
        if corrupted:
            raise DataLoss(f"weights arrived corrupted on {', '.join(corrupted)} (bucket checksums differ)")
        if failed:
            if all(
                isinstance(a, grpc.aio.AioRpcError) and a.code() == grpc.StatusCode.FAILED_PRECONDITION
                for a in answers
                if isinstance(a, BaseException)
            ):
                raise FailedPrecondition(
                    "generators refused the version: " + "; ".join(f"{r}: {w}" for r, w in failed.items())
                )
            raise Unavailable("weight push failed on: " + "; ".join(f"{r}: {w}" for r, w in failed.items()))
        return sent, [r for r in rids if r not in current]


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return f"{type(e).__name__}: {e}"
