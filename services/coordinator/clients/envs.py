"""The environment service as the coordinator calls it: a rotation of env replicas, an episode's
session pinned to the replica that opened it, a deadline on every call.

Which failures mean what: a replica that cannot be reached is taken out of rotation and the
episode whose session it held is lost (``EpisodeLost``): the episode runner runs it again on
another replica, never scores it. An internal error (the env's own code raised on this episode)
loses the episode the same way but leaves the replica in rotation. A session the replica no longer
knows (NOT_FOUND: it restarted, or the lease expired) is lost the same way. A Reset that finds
its replica full (RESOURCE_EXHAUSTED: ``max_sessions``) goes to the next replica, and waits for
room when all are full, within the deadline. Any
other error (INVALID_ARGUMENT for an unknown env or a bad task, FAILED_PRECONDITION for a step
out of order) is a bug or a misconfiguration that every replica would answer the same way: the
run stops on it (``ServiceRpcError``), naming the replica and the call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
from relayrl.common import logcontext
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.clients.rotation import DOWN_CODES, Replica, Rotation, rendezvous
from relayrl.coordinator.errors import ServiceRpcError
from relayrl.env.v1 import env_pb2 as ev
from relayrl.env.v1 import env_pb2_grpc as evg

FULL_RETRY_S = 0.2
"""Wait before asking a full replica (RESOURCE_EXHAUSTED) again."""


class Full(Exception):
    """An env replica answered RESOURCE_EXHAUSTED to a Reset: it holds ``max_sessions``."""


class EpisodeLost(Exception):
    """The replica holding an episode's session failed, or lost the session: run it again."""


class EnvPool(Rotation):
    def __init__(
        self,
        replicas: dict[str, str],
        deadline_s: float,
        security: ClientSecurity | None = None,
        wait_s: float = 600.0,
        probe_s: float = 5.0,
        coming_back: Callable[[str], bool] | None = None,
    ):
        super().__init__(
            "env",
            replicas,
            "relayrl.env.v1.EnvService",
            security,
            probe_s=probe_s,
            wait_s=wait_s,
            call_deadline_s=deadline_s,
            coming_back=coming_back,
        )
        self.deadline_s = deadline_s

    async def env_info(self, name: str) -> ev.EnvInfo:
        """The environment ``name`` as every replica in rotation describes it; raises
        ``ValueError`` when one does not run it, or runs another version of it (other tools)."""
        infos = []
        for rep in await self.available():
            resp = await self._call(rep, "ListEnvs", ev.ListEnvsRequest())
            found = [e for e in resp.envs if e.name == name]
            if not found:
                known = ", ".join(sorted(e.name for e in resp.envs)) or "none"
                raise ValueError(
                    f"episodes.env: env replica {rep.name} runs no env {name!r} (it runs: {known})"
                )
            infos.append(found[0])
        if any(i.tools_json != infos[0].tools_json for i in infos):
            raise ValueError(f"episodes.env: the env replicas disagree on the tools of {name!r}")
        return infos[0]

    async def reset(self, req: ev.ResetRequest) -> tuple[Replica, ev.ResetResponse]:
        """Open the episode's session on the replica its id hashes to among those in rotation;
        one that is full (``max_sessions``) passes it to the next in hash order; when all are,
        it waits and tries again within the deadline, then the episode is lost (redone later)."""
        until = time.monotonic() + self.deadline_s
        while True:
            reps = await self.available()
            while reps:
                rep = rendezvous(req.episode_id, reps)
                try:
                    return rep, await self._call(rep, "Reset", req)
                except Full:
                    reps = [r for r in reps if r is not rep]
            if time.monotonic() + FULL_RETRY_S >= until:
                raise EpisodeLost(f"every env replica stayed full (max_sessions) for {self.deadline_s:g}s")
            await asyncio.sleep(FULL_RETRY_S)

    async def step(self, rep: Replica, req: ev.StepRequest) -> ev.StepResponse:
        return await self._call(rep, "Step", req)

    async def close_session(self, rep: Replica, req: ev.CloseRequest) -> ev.CloseResponse:
        return await self._call(rep, "Close", req)

    async def _call(self, rep: Replica, rpc: str, req):
        """One call under the deadline; its failures mapped to what becomes of the episode."""
        try:
            stub = evg.EnvServiceStub(rep.channel)
            return await getattr(stub, rpc)(req, timeout=self.deadline_s, metadata=logcontext.current())
        except grpc.aio.AioRpcError as e:
            code, why = e.code(), (e.details() or "")[:300]
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and rpc == "Reset":
                raise Full(rep.name) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # an answer too large: the session is stuck
                raise EpisodeLost(f"env {rep.name}: {rpc} RESOURCE_EXHAUSTED: {why}") from None
            if code in DOWN_CODES:
                # INTERNAL is the env's own code failing on this episode (a plugin raised): the
                # episode is redone, the replica keeps serving the others.
                if code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    self.mark_down(rep, f"{code.name}: {why}")
                raise EpisodeLost(f"env {rep.name}: {rpc} {code.name}: {why}") from None
            if code == grpc.StatusCode.NOT_FOUND and rpc in ("Step", "Close"):
                raise EpisodeLost(f"env {rep.name}: {rpc}: session lost ({why})") from None
            raise ServiceRpcError(e, f"env {rep.name} ({rep.address})", rpc) from None
