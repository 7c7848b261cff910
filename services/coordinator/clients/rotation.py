"""Replicas of one service in and out of rotation, and what every pool of them shares: the
codes that take a replica out (``DOWN_CODES``), the replica a key sticks to (``rendezvous``) and
the count of failed tries per piece of work (``Attempts``).

A replica whose call failed leaves the rotation (``mark_down``). It is not gone for good: a
container that crashed, was OOM-killed or rolled to a new image comes back at the same address a
few minutes later. So every ``probe_s`` a replica out of rotation is asked the gRPC health
protocol on a fresh channel with a subchannel of its own (a channel to a dead peer backs off for
up to two minutes between reconnects); once it answers SERVING, ``readmit`` runs (for generators: register with the learner
and take its current weights, so the replica never samples with an older policy) and the replica
is back. A replica that is up but not ready only because it waits for weights (a generator whose
load was broken by a peer that died mid-broadcast: ``admit_unready`` says which) is readmitted too:
the readmission's push is what makes it ready, so waiting for SERVING first would wait forever.
Probes and readmissions run in the background (a readmission takes as long as a registration and
a weight push): callers with a replica in rotation never wait for them. Callers that find no
replica in rotation wait for one up to ``wait_s`` before ``NoReplicaLeft``: a run with one
generator outlives that generator's restart instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from relayrl.common.affinity import ranked
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.errors import AttemptsExhausted, NoReplicaLeft

logger = logging.getLogger(__name__)
OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
PROBE_TIMEOUT_S = 5.0
# Codes after which a replica is taken out of rotation (it is gone or not serving).
DOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


@dataclass
class Replica:
    name: str
    address: str
    channel: grpc.aio.Channel = field(repr=False)
    healthy: bool = True


def rendezvous(key: str, reps: Sequence[Replica]) -> Replica:
    """The replica ``key`` goes to (``affinity.ranked``): it keeps it while that replica is in
    rotation.

    >>> reps = [Replica(f"gen-{i}", "", None) for i in range(3)]
    >>> rendezvous("e1", reps).name == rendezvous("e1", reps[::-1]).name
    True
    """
    by_name = {rep.name: rep for rep in reps}
    return by_name[ranked(key, by_name)[0]]


class Attempts:
    """Failed tries per piece of work, with their reasons; ``failed`` raises
    ``AttemptsExhausted`` at the ``limit``-th failure of one piece."""

    def __init__(self, what: str, limit: int):
        self.what, self.limit = what, limit
        self.errors: dict[str, list[str]] = {}

    def failed(self, key: str, why: str) -> None:
        errors = self.errors.setdefault(key, [])
        errors.append(why[:300])
        if len(errors) >= self.limit:
            raise AttemptsExhausted(
                f"{self.what} {key[:100]} failed on all {self.limit} attempts (services.max_attempts): "
                + "; ".join(errors)
            )


class Rotation:
    """The replicas of one service (``kind``, e.g. "generator"), whose health service is
    ``service_name``. ``readmit(name, address)`` runs before a recovered replica takes work;
    if it raises, the replica stays out and is probed again later."""

    def __init__(
        self,
        kind: str,
        replicas: dict[str, str],
        service_name: str,
        security: ClientSecurity | None = None,
        readmit: Callable[[str, str], Awaitable[None]] | None = None,
        on_down: Callable[[str], None] | None = None,
        probe_s: float = 5.0,
        wait_s: float = 600.0,
        admit_unready: Callable[[grpc.aio.Channel], Awaitable[bool]] | None = None,
        call_deadline_s: float = 600.0,
        coming_back: Callable[[str], bool] | None = None,
    ):
        """``admit_unready(channel)``: whether a replica answering NOT_SERVING is readmitted all
        the same (it needs what ``readmit`` gives it). ``coming_back(name)``: whether a replica
        out of rotation is being restarted by its supervisor; the wait for one goes on while it
        is (the restart has its own deadline), past ``wait_s``."""
        self.kind = kind
        self.admit_unready = admit_unready
        self.coming_back = coming_back or (lambda name: False)
        self.call_deadline_s = call_deadline_s
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}  # replaced channels closing
        self.service_name = service_name
        self.security = security
        self.readmit = readmit
        self.on_down = on_down
        self.probe_s = probe_s
        self.wait_s = wait_s
        self.replicas = [Replica(n, a, client_channel(a, security, OPTIONS)) for n, a in replicas.items()]
        self._next_probe: dict[str, float] = {}
        self._probe_began: dict[str, float] = {}  # when each replica's last probe began
        self._probing: dict[str, asyncio.Task] = {}  # name -> its probe (and readmission) under way
        self._ticker: asyncio.TimerHandle | None = None  # the next probe round while one is out
        self._closed = False

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def mark_down(self, rep: Replica, why: str) -> None:
        if rep.healthy:
            rep.healthy = False
            self._next_probe[rep.name] = time.monotonic() + self.probe_s
            logger.warning("%s %s (%s) taken out of rotation: %s", self.kind, rep.name, rep.address, why)
            if self.on_down:
                self.on_down(rep.name)
            self._tick_soon()

    def _tick_soon(self) -> None:
        """Probe on a clock of its own while a replica is out of rotation: were probes started
        only when a caller asks for replicas, a replica marked down just after the last ask of a
        run's final steps would never be probed (its probe falls due between two asks)."""
        if self._ticker is None and not self._closed:
            self._ticker = asyncio.get_running_loop().call_later(self.probe_s, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        self.rejoin()
        if any(not r.healthy for r in self.replicas):
            self._tick_soon()

    async def available(self) -> list[Replica]:
        """The replicas in rotation (the probes of those out of it that are due start in the
        background); when none is in, wait for one, probing every ``probe_s``, for at most
        ``wait_s``."""
        self.rejoin()
        deadline = time.monotonic() + self.wait_s
        restarting, restart_over_at = False, None
        while not (reps := self.healthy()):
            if any(self.coming_back(r.name) for r in self.replicas):
                # Its restart is bounded by its own deadline; once over, one more probe finds it.
                restarting, restart_over_at = True, None
                deadline = max(deadline, time.monotonic() + self.probe_s)
            elif restarting:
                restarting, restart_over_at = False, time.monotonic()
            left = deadline - time.monotonic()
            probing = list(self._probing.values())
            if left <= 0 and not probing:  # a probe under way may still bring one back: its answer
                if restart_over_at is not None and not self._probed_since(restart_over_at):
                    # The restart ended, and no probe began since: under load this loop can wake
                    # past the deadline before the next probe falls due, and would give up on a
                    # replica that is up and was never asked. Ask it now; its answer decides.
                    self._next_probe.clear()
                    self.rejoin()
                    continue
                raise NoReplicaLeft(
                    f"no {self.kind} replica left; none came back within {self.wait_s:.0f} s "
                    f"(services.replica_wait_seconds)"
                )
            if probing:  # asyncio.wait: a waiter that leaves does not cancel a probe for the others
                await asyncio.wait(probing, timeout=self.probe_s)
            else:
                await asyncio.sleep(min(self.probe_s, left))
            self.rejoin()
        return reps

    def rejoin(self) -> None:
        """Start the probe of each replica out of rotation whose probe is due and is not being
        probed already."""
        now = time.monotonic()
        for rep in self.replicas:
            if self._closed:
                return
            if rep.healthy or rep.name in self._probing or now < self._next_probe.get(rep.name, 0.0):
                continue
            self._next_probe[rep.name] = now + self.probe_s
            self._probe_began[rep.name] = now
            task = asyncio.ensure_future(self._probe(rep))
            self._probing[rep.name] = task
            task.add_done_callback(lambda _t, name=rep.name: self._probing.pop(name, None))

    def _probed_since(self, t: float) -> bool:
        """Every replica out of rotation had a probe begin at ``t`` or later."""
        return all(self._probe_began.get(r.name, -1.0) >= t for r in self.replicas if not r.healthy)

    async def probed(self) -> None:
        """Start the probes that are due and wait for every probe under way to end."""
        self.rejoin()
        # wait: each probe is bounded (PROBE_TIMEOUT_S, then a readmission under its deadlines)
        await asyncio.wait(list(self._probing.values())) if self._probing else None

    async def _probe(self, rep: Replica) -> None:
        if await self._recovered(rep):
            rep.healthy = True
            logger.warning("%s %s (%s) back in rotation", self.kind, rep.name, rep.address)
        self._next_probe[rep.name] = time.monotonic() + self.probe_s  # from its end, not start

    async def drop_unserving(self) -> list[str]:
        """Probe the replicas in rotation; those that do not answer at all leave it. Returns
        their names (after a failure that names no replica, e.g. a broken weight push). A
        replica that answers NOT_SERVING stays: generators say so while swapping weights."""
        reps = self.healthy()
        whys = await asyncio.gather(*(self._check(r.channel) for r in reps))
        gone = [
            (rep, why) for rep, why in zip(reps, whys, strict=True) if why and not why.startswith("health ")
        ]
        for rep, why in gone:
            self.mark_down(rep, why)
        return [rep.name for rep, _ in gone]

    async def _check(self, channel: grpc.aio.Channel) -> str:
        """ "" when the replica answers SERVING, else why not ("health NOT_SERVING" when it
        answers otherwise, the RPC's error when it does not answer)."""
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=self.service_name), timeout=PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name} {e.details()}"
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return "health " + health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return ""

    async def _recovered(self, rep: Replica) -> bool:
        # A subchannel of its own: gRPC shares subchannels between channels to one address, and
        # the shared one of a dead peer waits out a growing reconnect backoff (up to 2 min).
        channel = client_channel(
            rep.address, self.security, [*OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        )
        adopted = False
        try:
            why = await self._check(channel)
            if why.startswith("health ") and self.readmit and self.admit_unready:
                if await self.admit_unready(channel):
                    why = ""
            if not why and self.readmit:
                try:
                    await self.readmit(rep.name, rep.address)
                except Exception as e:  # any failure leaves it out; it is tried again later
                    detail = (
                        f"{e.code().name} {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                    )
                    why = f"serving, but not readmitted: {detail}"
            if why:
                # A replica that serves but cannot be readmitted is a problem someone must see;
                # one that is still down is what a probe expects.
                level = logging.WARNING if why.startswith("serving") else logging.INFO
                logger.log(level, "%s %s still out of rotation: %s", self.kind, rep.name, why)
                return False
            old, rep.channel, adopted = rep.channel, channel, True
            # Calls may still run on the old channel (eval and training share a pool): closed
            # at once it would cancel them, and a cancelled call reads like a cancelled caller.
            retire = asyncio.ensure_future(old.close(grace=self.call_deadline_s))
            self._retiring[retire] = old
            retire.add_done_callback(lambda t: self._retiring.pop(t, None))
            return True
        finally:
            if not adopted:
                await channel.close()

    async def close(self) -> None:
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._probing.values()):
            task.cancel()  # the run is over: no replica is taken back
        await asyncio.gather(*self._probing.values(), return_exceptions=True)  # wait: just cancelled
        for r in self.replicas:
            await r.channel.close()
        for retire, old in list(self._retiring.items()):
            retire.cancel()  # the run is over: nothing waits for their calls any more
            await old.close()
