"""Rank 0's side of weight sync: registered generators, the weight-sync group, one push.

A push: make sure a group exists whose members are exactly the registered generators (else
close it and form a new one: each member's InitWeightSync runs while rank 0 joins as rank 0),
send every member ``UpdateWeights(version, plan)``, run the collective gather + broadcast, then
collect the members' answers. A member that fails is dropped from the group (the next push forms
a new one without it) and the push reports UNAVAILABLE naming it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc
from relayrl.common import logcontext
from relayrl.common import weightsync as ws
from relayrl.common.rpc import DataLoss, FailedPrecondition, Unavailable
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.common.tensors import plan_to_proto
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner.core import WeightGroup

logger = logging.getLogger(__name__)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "", 0))
        return s.getsockname()[1]


class WeightSync:
    def __init__(
        self,
        host: str,
        backend: str,
        dtype: str,
        timeout_s: float,
        deadline_s: float,
        metas: Callable[[str], list[ws.TensorMeta]],
        security: ClientSecurity | None = None,
    ):
        self.host = host
        self.backend = backend
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._metas = metas
        self.security = security  # how rank 0 reaches the generators (TLS, token)
        self.addresses: dict[str, str] = {}
        self.versions: dict[str, int] = {}
        self.group: WeightGroup | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    # -- membership ------------------------------------------------------------------------
    def register(self, replica_id: str, address: str) -> None:
        if self.addresses.get(replica_id) != address:
            self.addresses[replica_id] = address
            self.versions.pop(replica_id, None)
            old = self._channels.pop(replica_id, None)
            if old is not None:
                asyncio.ensure_future(old.close())

    async def unregister(self, replica_id: str) -> None:
        self.addresses.pop(replica_id, None)
        self.versions.pop(replica_id, None)
        ch = self._channels.pop(replica_id, None)
        if ch is not None:
            await ch.close()

    def replica_ids(self) -> list[str]:
        return sorted(self.addresses)

    def members(self) -> list[tuple[str, str, int]]:
        return [(r, self.addresses[r], self.versions.get(r, 0)) for r in self.replica_ids()]

    def _stub(self, replica_id: str) -> gg.GeneratorServiceStub:
        ch = self._channels.get(replica_id)
        if ch is None:
            ch = self._channels[replica_id] = client_channel(
                self.addresses[replica_id],
                self.security,
                options=[("grpc.max_send_message_length", 256 << 20)],
            )
        return gg.GeneratorServiceStub(ch)

    # -- the group -------------------------------------------------------------------------
    async def _close_group(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        for rid in group.members:
            if rid in self.addresses:
                try:
                    await self._stub(rid).CloseWeightSync(g.CloseWeightSyncRequest(), timeout=30)
                except grpc.RpcError as e:
                    logger.warning(
                        "CloseWeightSync on %s failed: %s", rid, e.details() if hasattr(e, "details") else e
                    )
        try:
            group.pg.shutdown()
        except Exception:
            logger.debug("weight group shutdown failed", exc_info=True)

    async def _ensure_group(self) -> WeightGroup:
        wanted = set(self.addresses)
        if self.group is not None and set(self.group.members) == wanted:
            return self.group
        await self._close_group()
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
                        master_addr=self.host,
                        master_port=port,
                        world_size=nxt,
                        rank=ranks[r],
                        backend=self.backend,
                        timeout_seconds=self.timeout_s,
                    ),
                    timeout=self.timeout_s,
                )
            )
            for r in rids
        ]
        try:
            pg = await asyncio.to_thread(ws.open_group, self.host, port, nxt, 0, self.backend, self.timeout_s)
        except Exception as e:
            for c in calls:
                c.cancel()
            raise Unavailable(f"weight-sync group did not form: {e}") from None
        answers = await asyncio.gather(*calls, return_exceptions=True)
        bad = [f"{r}: {_why(a)}" for r, a in zip(rids, answers, strict=True) if isinstance(a, BaseException)]
        if bad:
            pg.shutdown()
            raise Unavailable("generators failed to join the weight-sync group: " + "; ".join(bad))
        self.group = WeightGroup(pg=pg, members=ranks, world_size=nxt)
        logger.info("weight-sync group formed: %s (world %d)", ranks, nxt)
        return self.group

    # -- a push ----------------------------------------------------------------------------
    async def push(
        self,
        version: int,
        bucket_bytes: int,
        collective: Callable[[WeightGroup | None], Awaitable[tuple[int, list[int]]]],
        transport_only: bool = False,
    ) -> tuple[int, list[str]]:
        if not self.addresses:
            return 0, []
        if not transport_only and all(self.versions.get(r) == version for r in self.addresses):
            return 0, sorted(self.addresses)  # all current: idempotent by version
        group = await self._ensure_group()
        plan = plan_to_proto(ws.plan_buckets(self._metas(self.dtype), bucket_bytes))
        req = g.UpdateWeightsRequest(version=version, plan=plan, transport_only=transport_only)
        rids = sorted(group.members)
        with logcontext.bound(version=version):
            meta = logcontext.current()
        calls = [
            asyncio.ensure_future(self._stub(r).UpdateWeights(req, timeout=self.deadline_s, metadata=meta))
            for r in rids
        ]
        try:
            sent, sums = await collective(group)
        except Exception:
            for c in calls:
                c.cancel()
            await self._close_group()
            raise
        answers = await asyncio.gather(*calls, return_exceptions=True)
        failed, corrupted = [], []
        for r, a in zip(rids, answers, strict=True):
            if isinstance(a, BaseException):
                failed.append(f"{r}: {_why(a)}")
            elif list(a.bucket_checksums) != sums:
                corrupted.append(r)
            elif not transport_only:
                self.versions[r] = a.version
        if corrupted:
            await self._close_group()
            raise DataLoss(f"weights arrived corrupted on {', '.join(corrupted)} (bucket checksums differ)")
        if failed:
            await self._close_group()
            if all(
                isinstance(a, grpc.aio.AioRpcError) and a.code() == grpc.StatusCode.FAILED_PRECONDITION
                for a in answers
                if isinstance(a, BaseException)
            ):
                raise FailedPrecondition("generators refused the version: " + "; ".join(failed))
            raise Unavailable("weight push failed on: " + "; ".join(failed))
        return sent, rids


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return f"{type(e).__name__}: {e}"
