"""Rank 0's side of weight sync: registered generators, the transport of each, one push.

Registration picks a replica's transport from where both run (``transports.choose``: CUDA IPC on
the learner's GPU, shared memory on its host, NCCL to other GPUs, gloo across CPU hosts) or the
forced one, and opens it at once: a group transport forms its group with the replica in it, a
shared-memory or IPC transport has the replica open a probe the learner made. A transport that
cannot work is refused there with the reason (after trying the next one down in auto mode:
IPC -> shared memory, shared memory -> gloo), never at a push; a member that refuses to join a
group ends the formation at once (``groupform``).

A push: every replica is asked its version (one that holds the pushed version already only
drains a broadcast: an earlier push that failed may have reached it), every group is formed with
exactly its members; group members get
``UpdateWeights(version, plan)``, shared-memory members ``UpdateWeights`` naming the segment and
its ready table, and the collective gather + send runs (``push.send_buckets``: broadcasts, the
bytes written into the segment and marked ready bucket by bucket, and into the IPC buffers);
then the IPC members get ``UpdateWeights`` naming the buffers. The staging
segment and buffers are reused at the next push only after every member answered. A member that
fails is dropped from its transport (its group re-forms without it) and the push reports
UNAVAILABLE naming it, after the others got the version. Each answer must carry the version
pushed and, per bucket, the checksum of what was sent; a replica whose answer differs fails the
push with DATA_LOSS naming it.

Locks: registrations and pushes queue on this object's own ``lock``; only the gather + send of a
push runs inside the caller's ``exclusive`` (the learner's collective lock, which TrainStep
takes): no slow or silent replica holds a training step. The answers are waited for after it,
at most ``timeout_s``: a replica silent that long is named in the error and its staging memory
is not written again (``staging.renew``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

import grpc
from relayrl.common import logcontext
from relayrl.common.placement import gpu_uuid, host_id
from relayrl.common.rpc import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    ServiceError,
    Unavailable,
    to_the_end,
)
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.common.weightsync.cudaipc import shared_to_proto
from relayrl.common.weightsync.plan import Bucket, TensorMeta, plan_buckets, plan_to_proto
from relayrl.common.weightsync.shm import Segment
from relayrl.common.weightsync.transports import GROUP_BACKEND, Place, choose
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner import groupform
from relayrl.learner.push import Sinks, WeightGroup, answers
from relayrl.learner.staging import Staging

logger = logging.getLogger(__name__)
CONTROL_RPC_S = 30.0  # at most, for the replicas' quick calls (GetStatus, CloseWeightSync)

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


@contextlib.asynccontextmanager
async def _alone():
    yield


class WeightSync:
    def __init__(
        self,
        host: str,
        device: str,
        dtype: str,
        timeout_s: float,
        deadline_s: float,
        metas: Callable[[str], list[TensorMeta]],
        security: ClientSecurity | None = None,
        transport: str = "auto",
    ):
        self.host = host
        self.device = device  # the learner's: "cpu" or "cuda:<i>"
        self.dtype = dtype
        self.timeout_s = timeout_s
        # GetStatus and CloseWeightSync answer in milliseconds from a live replica: a hung one
        # must not hold a push (or the coordinator's call for it) longer than this.
        self.control_s = min(CONTROL_RPC_S, timeout_s)
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
        self.staging = Staging(device)
        self._push_id = 0  # pushes through the staging segment so far (marks in its ready table)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.lock = asyncio.Lock()  # registrations and pushes, one at a time

    # -- membership ------------------------------------------------------------------------
    async def register(self, replica_id: str, address: str, deadline: float | None = None) -> str:
        """Add a replica and open its transport now; returns the transport. A replica that
        registers again starts afresh (it is most likely a restarted process: its side of any
        weight-sync group is gone, and it serves the weights it loaded, not the last ones sent).
        Nothing is done when ``deadline`` (monotonic) passed while it waited for its turn, and a
        registration cancelled part-way (its caller gave up) is undone."""
        # wait: registrations and pushes one at a time, each bounded (RPC timeouts,
        # weight_sync_timeout_seconds); the caller's deadline or cancellation ends the wait
        async with self.lock:
            _check(deadline, "registration")
            if replica_id in self.addresses:
                await self._unregister(replica_id)
            self.addresses[replica_id] = address
            try:
                return await self._open(replica_id)
            except BaseException:
                await to_the_end(self._unregister(replica_id), stay=True)
                raise

    async def unregister(self, replica_id: str, deadline: float | None = None) -> None:
        """Forget a replica (its group re-forms without it at the next push); not done when
        ``deadline`` passed before its turn, and not left half-done when its caller goes."""
        async with self.lock:  # wait: as for register
            _check(deadline, "unregistration")
            await to_the_end(self._unregister(replica_id), stay=True)

    async def _unregister(self, replica_id: str) -> None:
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
            st = await self._stub(rid).GetStatus(g.GetStatusRequest(), timeout=self.control_s)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"generator {rid} at {self.addresses[rid]} is unreachable: {_why(e)}") from None
        theirs = Place(st.host_id or f"unknown:{rid}", st.device or "cpu", tuple(st.gpu_uuids))
        self.versions[rid] = st.policy_version  # what it serves now: a push of that version skips it
        first = choose(self.place, theirs, self.forced)
        reasons = []
        for transport in [first, *(_FALLBACK.get(first, []) if self.forced == "auto" else [])]:
            try:
                if transport == "nccl" and theirs.device != "cuda":
                    # It would refuse to join, and the group's other members would wait for it.
                    raise FailedPrecondition(f"generator {rid} runs on the CPU: no GPU for NCCL")
                await self._stub(rid).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=self.control_s)
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
            from relayrl.common.weightsync.cudaipc import share

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
        await self._close_syncs([r for r in group.members if r in self.addresses])

    async def _close_syncs(self, rids: list[str]) -> None:
        """CloseWeightSync on each of ``rids`` (a no-op where none is open)."""
        closed = await asyncio.gather(
            *(
                self._stub(r).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=self.control_s)
                for r in rids
            ),
            return_exceptions=True,
        )
        for r, e in zip(rids, closed, strict=True):
            if isinstance(e, BaseException):
                logger.warning("CloseWeightSync on %s failed: %s", r, _why(e))

    async def _ensure_group(self, backend: str) -> WeightGroup:
        wanted = {r for r, t in self.transports.items() if GROUP_BACKEND.get(t) == backend}
        group = self.groups.get(backend)
        if group is not None and set(group.members) == wanted:
            return group
        await self._close_group(backend)
        if backend == "nccl" and not self.device.startswith("cuda"):
            raise RuntimeError("nccl needs the learner on a GPU")
        rids = sorted(wanted)
        # Whatever a member may still hold open (a formation that failed after it had joined,
        # a close whose caller was cancelled) is closed first: it would refuse to join otherwise.
        await self._close_syncs(rids)
        statuses = await asyncio.gather(
            *(self._stub(r).GetStatus(g.GetStatusRequest(), timeout=self.control_s) for r in rids),
            return_exceptions=True,
        )
        ranks, nxt = {}, 1
        for r, st in zip(rids, statuses, strict=True):
            if isinstance(st, BaseException):
                raise Unavailable(f"generator {r} at {self.addresses[r]} is unreachable: {_why(st)}")
            ranks[r] = nxt
            nxt += max(1, st.weight_sync_ranks)
        port = free_port(self.host)
        joined = groupform.join_in_thread(self.host, port, nxt, backend, self.timeout_s)
        calls = {
            r: asyncio.ensure_future(
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
        }
        spans = {
            r: range(ranks[r], ranks[r] + max(1, st.weight_sync_ranks))
            for r, st in zip(rids, statuses, strict=True)
        }
        where = (self.host, port, nxt, self.timeout_s)
        pg, store = await groupform.form(joined, calls, spans, where, backend, _why)
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
            *(self._stub(r).GetStatus(g.GetStatusRequest(), timeout=self.control_s) for r in rids),
            return_exceptions=True,
        )
        closed = []
        for r, st in zip(rids, statuses, strict=True):
            if not isinstance(st, BaseException):
                self.versions[r] = st.policy_version
                if not st.weight_sync_open and r in self.transports:
                    closed.append(r)
        for r in closed:
            await self._reopen(r)

    async def _reopen(self, rid: str) -> None:
        """A member whose weight sync is closed: a process restarted at its address (a crash
        the coordinator has not seen yet: it holds its initial weights), or a member of a group
        that broke. Opened again, so this push reaches it like the others."""
        transport = self.transports[rid]
        if transport in GROUP_BACKEND:
            group = self.groups.get(GROUP_BACKEND[transport])
            if group is not None and rid in group.members:
                logger.warning(
                    "generator %s left its %s group (restarted?): the group re-forms", rid, transport
                )
                await self._close_group(GROUP_BACKEND[transport])  # re-formed with it by the push
            return
        logger.warning("generator %s has no %s sync open (restarted?): opening it again", rid, transport)
        try:
            await self._open(rid)
        except (ServiceError, grpc.aio.AioRpcError) as e:
            raise Unavailable(
                f"generator {rid} lost its weight sync and it cannot be opened again: {_why(e)}"
            ) from e

    def close(self) -> None:
        """Free the staging memory (the learner is stopping)."""
        self.staging.close()

    # -- a push ------------------------------------------------------------------------------
    async def push(
        self,
        version: int,
        bucket_bytes: int,
        collective: Callable[[list[Bucket], Sinks], Awaitable[tuple[int, list[int]]]],
        transport_only: bool = False,
        exclusive: Callable[[], AbstractAsyncContextManager] = _alone,
    ) -> tuple[int, list[str]]:
        """Push ``version`` to every registered replica; ``collective`` (the gather + send of the
        plan made here, the push's only one: every rank and every replica gets it) runs inside
        ``exclusive()``, which is entered even when there is nothing to send (it checks the
        version). Returns the bytes sent and the replicas that loaded it."""
        async with self.lock:  # wait: as for register
            if not self.addresses:
                async with exclusive():
                    return 0, []
            await self._refresh_versions()
            if not transport_only and all(self.versions.get(r) == version for r in self.addresses):
                async with exclusive():
                    return 0, sorted(self.addresses)  # all current: idempotent by version
            for backend in sorted({GROUP_BACKEND[t] for t in self.transports.values() if t in GROUP_BACKEND}):
                await self._ensure_group(backend)
            buckets = plan_buckets(self._metas(self.dtype), bucket_bytes)
            # Replicas at `version` already (one came back and the others are current): a group's
            # members all take part in its broadcast, so the current ones drain it and keep their
            # weights (transport_only); over SHM or IPC they are not called at all.
            current = (
                set() if transport_only else {r for r in self.addresses if self.versions.get(r) == version}
            )
            requests, sinks, abort = self._requests(version, buckets, transport_only, current)
            with logcontext.bound(version=version):
                meta = logcontext.current()

            def call(r: str) -> asyncio.Future:
                return asyncio.ensure_future(
                    self._stub(r).UpdateWeights(requests[r], timeout=self.deadline_s, metadata=meta)
                )

            # Group members receive while the learner sends; shared-memory replicas load each
            # bucket as the ready table marks it, while the learner gathers the next.
            early = sorted(r for r in requests if self.transports[r] in (*GROUP_BACKEND, "shm"))
            failure = None
            async with exclusive():
                calls = {r: call(r) for r in early}
                try:
                    sent, sums = await collective(buckets, sinks)
                except Exception as e:  # cleaned up below, once training may go on
                    failure = e
            if failure is not None:
                abort()  # shared-memory readers stop waiting at once
                for c in calls.values():
                    c.cancel()
                for backend in list(self.groups):
                    await self._close_group(backend, abandon=True)
                raise failure
            # IPC: the buffers are filled
            calls.update({r: call(r) for r in sorted(requests) if r not in calls})
            await self._answers(calls, version, sums, current, transport_only)
            return sent, [r for r in sorted(calls) if r not in current]

    def _requests(
        self, version: int, buckets: list[Bucket], transport_only: bool, current: set[str]
    ) -> tuple[dict[str, g.UpdateWeightsRequest], Sinks, Callable[[], None]]:
        """Each replica's UpdateWeights, the sinks of the collective, and what gives the push up
        for the shared-memory readers."""
        base = g.UpdateWeightsRequest(
            version=version, plan=plan_to_proto(buckets), transport_only=transport_only
        )
        sinks = Sinks(groups=[self.groups[b] for b in sorted(self.groups)])
        drain = g.UpdateWeightsRequest()
        drain.CopyFrom(base)
        drain.transport_only = True
        requests = {
            r: drain if r in current else base for r, t in self.transports.items() if t in GROUP_BACKEND
        }
        abort: Callable[[], None] = lambda: None  # noqa: E731
        if any(t == "shm" for t in self.transports.values()):
            seg, offsets, table = self.staging.shm(buckets)
            self._push_id += 1
            push_id = self._push_id
            sinks.shm, sinks.shm_offsets = seg.view(), offsets
            sinks.on_ready = lambda i, checksum: table.mark(i, push_id, checksum)
            abort = lambda: table.abort(push_id)  # noqa: E731
            req = g.UpdateWeightsRequest()
            req.CopyFrom(base)
            req.shm.segment, req.shm.offsets[:] = seg.name, offsets
            req.shm.push_id, req.shm.ready_offset = push_id, 0
            requests.update({r: req for r, t in self.transports.items() if t == "shm" and r not in current})
        if any(t == "ipc" for t in self.transports.values()):
            bufs, shared = self.staging.ipc(buckets)
            sinks.ipc = bufs
            req = g.UpdateWeightsRequest()
            req.CopyFrom(base)
            req.ipc.buffers.extend(shared)
            requests.update({r: req for r, t in self.transports.items() if t == "ipc" and r not in current})
        return requests, sinks, abort

    async def _answers(
        self,
        calls: dict[str, asyncio.Future],
        version: int,
        sums: list[int],
        current: set[str],
        transport_only: bool,
    ) -> None:
        """Check every replica's answer against what was sent (``push.answers``). Failed replicas
        leave their group (it re-forms); a silent one may still read this push's staging memory,
        which the next push does not write again."""
        failed, corrupted, loaded = await answers(
            calls, version, sums, current, transport_only, self.timeout_s
        )
        self.versions.update(loaded)
        if any(isinstance(failed[r], str) and self.transports.get(r) in ("shm", "ipc") for r in failed):
            self.staging.renew()
        for r in [*failed, *corrupted]:
            transport = self.transports.get(r)
            if transport in GROUP_BACKEND:  # its group re-forms at the next push
                await self._close_group(GROUP_BACKEND[transport])
        if corrupted:
            raise DataLoss(
                "weights did not arrive as sent on " + "; ".join(f"{r}: {w}" for r, w in corrupted.items())
            )
        if failed:
            whys = "; ".join(f"{r}: {w if isinstance(w, str) else _why(w)}" for r, w in failed.items())
            if all(
                isinstance(w, grpc.aio.AioRpcError) and w.code() == grpc.StatusCode.FAILED_PRECONDITION
                for w in failed.values()
            ):
                raise FailedPrecondition("generators refused the version: " + whys)
            raise Unavailable("weight push failed on: " + whys)


def _check(deadline: float | None, what: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExceeded(
            f"the caller's deadline passed before the {what} could start; nothing was done"
        )


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return f"{type(e).__name__}: {e}"
