"""The gateway as the coordinator calls it: a rotation of gateway replicas, one session per
black-box episode on the replica its id hashes to, a deadline on every call.

A replica that cannot be reached, or that lost the session (NOT_FOUND: it restarted, or the
session expired), loses the episode (``EpisodeLost``): it is run again, never scored. A full
replica (RESOURCE_EXHAUSTED: ``max_sessions``) passes the session to the next. Any other error is
a bug or a misconfiguration every replica would answer alike: the run stops on it."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from relayrl.common import logcontext
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.clients.envs import EpisodeLost
from relayrl.coordinator.clients.rotation import DOWN_CODES, Replica, Rotation, rendezvous
from relayrl.coordinator.errors import ServiceRpcError
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.gateway.v1 import gateway_pb2_grpc as gwg


class GatewayPool(Rotation):
    def __init__(
        self,
        replicas: dict[str, str],
        deadline_s: float,
        security: ClientSecurity | None = None,
        wait_s: float = 600.0,
        coming_back: Callable[[str], bool] | None = None,
    ):
        super().__init__(
            "gateway",
            replicas,
            "relayrl.gateway.v1.GatewayService",
            security,
            wait_s=wait_s,
            call_deadline_s=deadline_s,
            coming_back=coming_back,
        )
        self.deadline_s = deadline_s

    async def open(self, req: gw.OpenSessionRequest) -> tuple[Replica, gw.OpenSessionResponse]:
        """A session for the episode on the replica its id hashes to (the next when it is full)."""
        reps = await self.available()
        why = ""
        while reps:
            rep = rendezvous(req.episode_id, reps)
            try:
                return rep, await self._call(rep, "OpenSession", req)
            except grpc.aio.AioRpcError as e:  # RESOURCE_EXHAUSTED only (_call maps the rest)
                why = f"{rep.name}: {(e.details() or '')[:200]}"
                reps = [r for r in reps if r is not rep]
        raise EpisodeLost(f"every gateway replica is full (max_sessions): {why}")

    async def close_session(self, rep: Replica, key: str, request_id: str) -> gw.CloseSessionResponse:
        return await self._call(
            rep, "CloseSession", gw.CloseSessionRequest(request_id=request_id, session_key=key)
        )

    async def _call(self, rep: Replica, rpc: str, req):
        try:
            stub = gwg.GatewayServiceStub(rep.channel)
            return await getattr(stub, rpc)(req, timeout=self.deadline_s, metadata=logcontext.current())
        except grpc.aio.AioRpcError as e:
            code, why = e.code(), (e.details() or "")[:300]
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and rpc == "OpenSession":
                raise
            if code in DOWN_CODES:
                if code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    self.mark_down(rep, f"{code.name}: {why}")
                raise EpisodeLost(f"gateway {rep.name}: {rpc} {code.name}: {why}") from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise EpisodeLost(f"gateway {rep.name}: {rpc}: session lost ({why})") from None
            raise ServiceRpcError(e, f"gateway {rep.name} ({rep.address})", rpc) from None
