"""Rank 0's side of weight sync: registered generators, the transport of each, one push.

Registration picks a replica's transport from where both run (``weightsync.transports.choose``:
CUDA IPC on the learner's GPU, shared memory on its host, NCCL to other GPUs, gloo across CPU
hosts) or the forced one, and opens it at once (``Transport.open``, ``transports.py``). A
transport that cannot work is refused there with the reason (after trying the next one down in
auto mode: IPC -> shared memory, shared memory -> gloo), never at a push; a member that refuses to
join a group ends the formation at once (``groupform``).

A push: every replica is asked its version (one that holds the pushed version already only
drains a broadcast: an earlier push that failed may have reached it); the plan is made, once;
every transport in use stages it (``Transport.stage``: a group formed with exactly its members,
the segment and its ready table, the IPC buffers) and says what its members get in
``UpdateWeights``; the members that read while the learner writes are called (all of them:
``Transport.EARLY``), then the collective gather + send runs (``push.send_buckets``). The
staging memory is reused at the next push only after every member answered. A member that
fails leaves its transport (``Transport.leave``: its group re-forms without it) and the push
reports UNAVAILABLE naming it, after the others got the version. Each answer must carry the
version pushed and, per bucket, the checksum of what was sent; a replica whose answer differs
fails the push with DATA_LOSS naming it.

Locks: registrations and pushes queue on this object's own ``lock``; only the gather + send of a
push runs inside the caller's ``exclusive`` (the learner's collective lock, which TrainStep
takes): no slow or silent replica holds a training step. The answers are waited for after it,
at most ``timeout_s``: a replica silent that long is named in the error and its staging memory
is not written again (``Transport.renew``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from relayrl.common.weightsync.adapters import AdapterSpec
from relayrl.common.weightsync.plan import Bucket, TensorMeta, plan_buckets, plan_to_proto
from relayrl.common.weightsync.transports import Place, choose
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner import transports
from relayrl.learner.push import Sinks, WeightGroup, answers
from relayrl.learner.transports import why

logger = logging.getLogger(__name__)
CONTROL_RPC_S = 30.0  # at most, for the replicas' quick calls (GetStatus, CloseWeightSync)

_FALLBACK = {"ipc": ["shm"], "shm": ["gloo"]}
"""Auto mode: what to try when the chosen transport's probe fails."""


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
        adapter: AdapterSpec | None = None,
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
        self.adapter = adapter  # LoRA: every push carries the adapter's tensors and this shape
        cuda = device.startswith("cuda")
        uuid = gpu_uuid(int(device.split(":")[1]) if ":" in device else 0) if cuda else ""
        self.place = Place(host_id(), "cuda" if cuda else "cpu", (uuid,) if uuid else ())
        self.addresses: dict[str, str] = {}
        self.transports: dict[str, str] = {}
        self.versions: dict[str, int] = {}
        self.kinds = transports.make(self)  # rank 0's side of each transport, by name
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
        if transport is not None:  # a group re-forms without it at the next push
            await self.kinds[transport].leave(replica_id)
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

    @property
    def groups(self) -> dict[str, WeightGroup]:
        """The weight-sync groups open now, by backend."""
        return {
            k.backend: k.group
            for k in self.kinds.values()
            if isinstance(k, transports.GroupTransport) and k.group is not None
        }

    def stub(self, replica_id: str) -> gg.GeneratorServiceStub:
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
            st = await self.stub(rid).GetStatus(g.GetStatusRequest(), timeout=self.control_s)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"generator {rid} at {self.addresses[rid]} is unreachable: {why(e)}") from None
        theirs = Place(st.host_id or f"unknown:{rid}", st.device or "cpu", tuple(st.gpu_uuids))
        self.versions[rid] = st.policy_version  # what it serves now: a push of that version skips it
        first = choose(self.place, theirs, self.forced)
        reasons = []
        for transport in [first, *(_FALLBACK.get(first, []) if self.forced == "auto" else [])]:
            try:
                if transport == "nccl" and theirs.device != "cuda":
                    # It would refuse to join, and the group's other members would wait for it.
                    raise FailedPrecondition(f"generator {rid} runs on the CPU: no GPU for NCCL")
                await self.stub(rid).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=self.control_s)
                self.transports[rid] = transport
                await self.kinds[transport].open(rid)
                logger.info("generator %s: weight transport %s", rid, transport)
                return transport
            except (ServiceError, grpc.aio.AioRpcError, OSError, RuntimeError, ValueError) as e:
                self.transports.pop(rid, None)
                reasons.append(f"{transport}: {why(e)}")
        raise FailedPrecondition(f"no weight transport reaches generator {rid}: " + "; ".join(reasons))

    async def close_syncs(self, rids: list[str]) -> None:
        """CloseWeightSync on each of ``rids`` (a no-op where none is open)."""
        closed = await asyncio.gather(
            *(self.stub(r).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=self.control_s) for r in rids),
            return_exceptions=True,
        )
        for r, e in zip(rids, closed, strict=True):
            if isinstance(e, BaseException):
                logger.warning("CloseWeightSync on %s failed: %s", r, why(e))

    async def _refresh_versions(self) -> None:
        """Each replica's version as it says now. A push that failed may still have reached some
        (a broadcast completes on one member before it fails on another, and their answers are
        cancelled), and a restarted replica holds its initial weights: what was recorded at the
        last push is not enough to tell who must load and who must only drain. An unreachable
        replica keeps its record (the push fails on it anyway)."""
        rids = sorted(self.addresses)
        statuses = await asyncio.gather(
            *(self.stub(r).GetStatus(g.GetStatusRequest(), timeout=self.control_s) for r in rids),
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
        kind = self.kinds[transport]
        if isinstance(kind, transports.GroupTransport):
            if kind.holds(rid):
                logger.warning(
                    "generator %s left its %s group (restarted?): the group re-forms", rid, transport
                )
                await kind.close_group()  # re-formed with it by the push
            return
        logger.warning("generator %s has no %s sync open (restarted?): opening it again", rid, transport)
        try:
            await self._open(rid)
        except (ServiceError, grpc.aio.AioRpcError) as e:
            raise Unavailable(
                f"generator {rid} lost its weight sync and it cannot be opened again: {why(e)}"
            ) from e

    def close(self) -> None:
        """Free the staging memory (the learner is stopping)."""
        for kind in self.kinds.values():
            kind.close()

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
            buckets = plan_buckets(self._metas(self.dtype), bucket_bytes)
            # Replicas at `version` already (one came back and the others are current): a group's
            # members all take part in its broadcast, so the current ones drain it and keep their
            # weights (transport_only); over SHM or IPC they are not called at all.
            current = (
                set() if transport_only else {r for r in self.addresses if self.versions.get(r) == version}
            )
            used = [self.kinds[t] for t in sorted(set(self.transports.values()))]
            requests, sinks = await self._stage(used, version, buckets, transport_only, current)
            with logcontext.bound(version=version):
                meta = logcontext.current()

            def call(r: str) -> asyncio.Future:
                return asyncio.ensure_future(
                    self.stub(r).UpdateWeights(requests[r], timeout=self.deadline_s, metadata=meta)
                )

            # Group members receive while the learner sends; shared-memory and IPC replicas load
            # each bucket as the ready table marks it, while the learner gathers the next.
            early = sorted(r for r in requests if self.kinds[self.transports[r]].EARLY)
            failure = None
            async with exclusive():
                calls = {r: call(r) for r in early}
                try:
                    sent, sums = await collective(buckets, sinks)
                except Exception as e:  # cleaned up below, once training may go on
                    failure = e
            if failure is not None:
                for kind in used:
                    kind.abort()  # readers waiting for a bucket stop at once
                for c in calls.values():
                    c.cancel()
                for kind in used:
                    if isinstance(kind, transports.GroupTransport):
                        await kind.close_group(abandon=True)
                raise failure
            # a kind whose members read only once everything is sent (none now: EARLY)
            calls.update({r: call(r) for r in sorted(requests) if r not in calls})
            await self._answers(calls, version, sums, current, transport_only)
            return sent, [r for r in sorted(calls) if r not in current]

    async def _stage(
        self,
        used: list[transports.Transport],
        version: int,
        buckets: list[Bucket],
        transport_only: bool,
        current: set[str],
    ) -> tuple[dict[str, g.UpdateWeightsRequest], Sinks]:
        """Each replica's UpdateWeights and the sinks of the collective, from every transport in
        ``used``. Replicas in ``current`` are not called, except a group's: they drain it."""
        base = g.UpdateWeightsRequest(
            version=version, plan=plan_to_proto(buckets), transport_only=transport_only
        )
        if self.adapter is not None:
            a = self.adapter
            base.lora.CopyFrom(g.LoraAdapter(rank=a.rank, alpha=a.alpha, target_modules=a.target_modules))
        drain = g.UpdateWeightsRequest()
        drain.CopyFrom(base)
        drain.transport_only = True
        sinks, requests = Sinks(), {}
        for kind in used:
            req = await kind.stage(buckets, base, sinks)
            for r, t in self.transports.items():
                if t == kind.name and (kind.GROUP or r not in current):
                    requests[r] = drain if r in current else req
        return requests, sinks

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
        for r in failed:
            if isinstance(failed[r], str) and r in self.transports:  # silent: may still be reading
                self.kinds[self.transports[r]].renew()
        for r in [*failed, *corrupted]:
            if r in self.transports:  # a group re-forms at the next push
                await self.kinds[self.transports[r]].leave(r)
        if corrupted:
            raise DataLoss(
                "weights did not arrive as sent on " + "; ".join(f"{r}: {w}" for r, w in corrupted.items())
            )
        if failed:
            whys = "; ".join(f"{r}: {w if isinstance(w, str) else why(w)}" for r, w in failed.items())
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
