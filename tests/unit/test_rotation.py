"""Replicas out of rotation come back when they serve again (``coordinator/clients/rotation.py``):
probed over the gRPC health protocol, re-admitted (for generators: registered and given the
learner's weights) before any work, and waited for, within a bound, when none is left."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from relayrl.coordinator.clients.rotation import NoReplicaLeft, Rotation

SERVICE = "relayrl.generator.v1.GeneratorService"


class HealthServer:
    """A replica's health endpoint that can go away and come back at the same address."""

    def __init__(self):
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.health: health.aio.HealthServicer | None = None

    async def start(self, serving: bool = True) -> None:
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.serving(serving)
        await self.server.start()

    async def serving(self, yes: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if yes else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE, status)

    async def stop(self) -> None:
        await self.server.stop(None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def _rotation(servers, readmit=None, wait_s=5.0, downs=None):
    return Rotation(
        "generator",
        {f"gen-{i}": s.address for i, s in enumerate(servers)},
        SERVICE,
        readmit=readmit,
        on_down=downs.append if downs is not None else None,
        probe_s=0.05,
        wait_s=wait_s,
    )


async def test_a_replica_back_at_its_address_is_readmitted_before_it_takes_work():
    a, b = HealthServer(), HealthServer()
    await a.start()
    await b.start()
    admitted, downs = [], []

    async def readmit(name, address):
        admitted.append((name, address))

    rot = await _rotation([a, b], readmit, downs=downs)
    try:
        rep_b = rot.replicas[1]
        rot.mark_down(rep_b, "UNAVAILABLE: killed")
        rot.mark_down(rep_b, "again")  # counted once
        assert downs == ["gen-1"] and [r.name for r in rot.healthy()] == ["gen-0"]
        await b.stop()
        await asyncio.sleep(0.06)
        await rot.probed()
        assert [r.name for r in await rot.available()] == ["gen-0"]  # probed: still gone
        assert admitted == []
        await b.start(serving=False)  # up, model still loading
        await asyncio.sleep(0.06)
        await rot.probed()
        assert [r.name for r in await rot.available()] == ["gen-0"]
        assert admitted == []
        await b.serving(True)
        await asyncio.sleep(0.06)
        await rot.probed()
        assert [r.name for r in await rot.available()] == ["gen-0", "gen-1"]
        assert admitted == [("gen-1", b.address)]
        # its new channel reaches the new process
        resp = await health_pb2_grpc.HealthStub(rep_b.channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await rot.close()
        await a.stop()
        await b.stop()


async def test_a_failed_readmission_leaves_the_replica_out_and_it_is_tried_again():
    a = HealthServer()
    await a.start()
    calls = []

    async def readmit(name, address):
        calls.append(name)
        if len(calls) == 1:  # e.g. the learner's version moved under the push
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(), "moved"
            )

    rot = await _rotation([a], readmit, wait_s=5.0)
    try:
        rot.mark_down(rot.replicas[0], "UNAVAILABLE")
        await asyncio.sleep(0.06)
        reps = await rot.available()  # first readmission refused, the second (one probe later) taken
        assert [r.name for r in reps] == ["gen-0"] and calls == ["gen-0", "gen-0"]
    finally:
        await rot.close()
        await a.stop()


async def test_with_none_left_callers_wait_for_one_then_give_up_at_the_bound():
    a = HealthServer()
    await a.start()
    rot = await _rotation([a], wait_s=5.0)
    try:
        rot.mark_down(rot.replicas[0], "UNAVAILABLE")
        await a.stop()

        async def come_back():
            await asyncio.sleep(0.3)
            await a.start()

        back = asyncio.ensure_future(come_back())
        t0 = time.monotonic()
        reps = await rot.available()  # waits through the restart
        assert [r.name for r in reps] == ["gen-0"] and time.monotonic() - t0 >= 0.3
        await back
    finally:
        await rot.close()
        await a.stop()

    gone = HealthServer()
    await gone.start()
    rot = await _rotation([gone], wait_s=0.3)
    await gone.stop()
    try:
        rot.mark_down(rot.replicas[0], "UNAVAILABLE")
        t0 = time.monotonic()
        with pytest.raises(NoReplicaLeft, match="no generator replica left; none came back within"):
            await rot.available()
        assert 0.3 <= time.monotonic() - t0 < 5
    finally:
        await rot.close()


async def test_a_push_broken_by_a_dying_generator_is_made_again_without_it():
    """A generator that dies during a weight push fails the push for all (its broadcast group
    lost a member): the loop takes the replicas that no longer serve out of rotation and off the
    learner's list, and pushes again to the others."""
    from relayrl.coordinator.loop import Experiment
    from relayrl.learner.v1 import learner_pb2 as lp

    alive, dying = HealthServer(), HealthServer()
    await alive.start()
    await dying.start()

    class Learner:
        def __init__(self):
            self.pushes, self.unregistered = 0, []

        async def push_weights(self, version):
            self.pushes += 1
            if self.pushes == 1:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    "weight broadcast failed after 0 bytes",
                )
            return lp.PushWeightsResponse(version=version, replica_ids=["gen-0"])

        async def unregister_generator(self, name):
            self.unregistered.append(name)

    exp = Experiment.__new__(Experiment)
    exp.version, exp.learner = 3, Learner()
    exp.gen = await _rotation([alive, dying], wait_s=0)
    try:
        await dying.stop()
        _, updated = await exp.push()
        assert updated == 1 and exp.learner.pushes == 2
        assert exp.learner.unregistered == ["gen-1"] and [r.name for r in exp.gen.healthy()] == ["gen-0"]
    finally:
        await exp.gen.close()
        await alive.stop()

    class Refusing(Learner):
        async def push_weights(self, version):  # not a dead replica: the same answer again
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(), "version"
            )

    exp.learner = Refusing()
    with pytest.raises(grpc.aio.AioRpcError):
        await exp.push()


async def test_only_a_replica_that_does_not_answer_is_dropped_and_any_readmission_error_leaves_it_out():
    swapping, gone = HealthServer(), HealthServer()
    await swapping.start(serving=False)  # a generator answers NOT_SERVING while it swaps weights
    await gone.start()
    calls = []

    async def readmit(name, address):
        calls.append(name)
        raise RuntimeError("learner went away")  # not a gRPC error: still only a failed try

    rot = await _rotation([swapping, gone], readmit)
    try:
        await gone.stop()
        assert await rot.drop_unserving() == ["gen-1"]
        assert [r.name for r in rot.healthy()] == ["gen-0"]
        await gone.start()
        await asyncio.sleep(0.06)
        assert [r.name for r in await rot.available()] == ["gen-0"]  # its probe: in the background
        await rot.probed()
        assert calls == ["gen-1"] and [r.name for r in rot.healthy()] == ["gen-0"]
    finally:
        await rot.close()
        await swapping.stop()
        await gone.stop()


def _status_servicer(**fields):
    from relayrl.generator.v1 import generator_pb2_grpc

    class _Status(generator_pb2_grpc.GeneratorServiceServicer):
        """A generator's GetStatus, as the engine would answer it."""

        async def GetStatus(self, request, context):
            from relayrl.generator.v1 import generator_pb2

            return generator_pb2.GetStatusResponse(**fields)

    return _Status()


async def _generator(status) -> HealthServer:
    from relayrl.common.grpc_server import add_service
    from relayrl.generator.v1 import generator_pb2

    srv = HealthServer()
    srv.server = grpc.aio.server()
    srv.health = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(srv.health, srv.server)
    add_service(srv.server, status, generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"])
    srv.port = srv.server.add_insecure_port("127.0.0.1:0")
    await srv.serving(False)
    await srv.server.start()
    return srv


@pytest.mark.parametrize(
    ("status", "readmitted"),
    [
        # up, loaded, not swapping, not ready: its load broke half-way (a broadcast peer died)
        ({"ready": False, "swapping": False, "max_model_len": 64}, True),
        ({"ready": False, "swapping": False, "max_model_len": 0}, False),  # the model still loads
        ({"ready": False, "swapping": True, "max_model_len": 64}, False),  # mid swap
    ],
    ids=["weights-broken", "loading", "swapping"],
)
async def test_a_generator_waiting_for_weights_is_readmitted_though_not_serving(status, readmitted):
    """The survivor of a broken broadcast answers NOT_SERVING until a complete push: were it
    readmitted only once SERVING, it would stay out of rotation for good (seen in CI: a run of
    two generators ended on one). Its readmission is what pushes it the weights."""
    from relayrl.coordinator.clients.generators import GeneratorPool

    srv = await _generator(_status_servicer(**status))
    admitted = []

    async def readmit(name, address):
        admitted.append(name)
        await srv.serving(True)  # the push made it ready

    pool = GeneratorPool({"gen-0": srv.address}, 5.0, readmit=readmit, wait_s=0.5, probe_s=0.05)
    try:
        pool.mark_down(pool.replicas[0], "UNAVAILABLE: engine is not ready (a weight load failed)")
        await asyncio.sleep(0.06)
        if readmitted:
            assert [r.name for r in await pool.available()] == ["gen-0"] and admitted == ["gen-0"]
        else:
            with pytest.raises(NoReplicaLeft):
                await pool.available()
            assert admitted == []
    finally:
        await pool.close()
        await srv.stop()


async def test_a_readmission_lets_the_calls_on_the_old_channel_finish():
    """Evaluation and training share a pool: a call still running on a replica's old channel
    when the replica is readmitted must end with its answer, not be cancelled (a cancelled call
    reads as a cancelled caller)."""
    from relayrl.generator.v1 import generator_pb2, generator_pb2_grpc

    release = asyncio.Event()

    class Slow(generator_pb2_grpc.GeneratorServiceServicer):
        async def GetStatus(self, request, context):
            await release.wait()
            return generator_pb2.GetStatusResponse(replica_id="slow")

    srv = await _generator(Slow())
    await srv.serving(True)

    async def readmit(name, address):
        pass

    rot = await _rotation([srv], readmit)
    try:
        rep = rot.replicas[0]
        call = asyncio.ensure_future(
            generator_pb2_grpc.GeneratorServiceStub(rep.channel).GetStatus(
                generator_pb2.GetStatusRequest(), timeout=10
            )
        )
        await asyncio.sleep(0.1)
        rot.mark_down(rep, "another call failed")
        await asyncio.sleep(0.06)
        assert [r.name for r in await rot.available()] == ["gen-0"]  # readmitted on a new channel
        release.set()
        assert (await asyncio.wait_for(call, 10)).replica_id == "slow"
    finally:
        await rot.close()
        await srv.stop()


def _restarting(a: HealthServer, restarting: set[str]) -> Rotation:
    """One replica at ``a``, a short bound (0.1 s), and a supervisor restarting those named in
    ``restarting``."""
    return Rotation(
        "generator",
        {"gen-0": a.address},
        SERVICE,
        probe_s=0.05,
        wait_s=0.1,
        coming_back=restarting.__contains__,
    )


async def test_callers_wait_past_the_bound_for_a_replica_its_supervisor_is_restarting():
    """A short ``replica_wait_seconds`` gives up on a hung replica quickly; a crashed one that
    the embedded supervisor is starting again (vLLM takes a while to load) is waited for."""
    a = HealthServer()
    await a.start()
    restarting = {"gen-0"}
    rot = _restarting(a, restarting)
    try:
        rot.mark_down(rot.replicas[0], "UNAVAILABLE: killed")
        await a.stop()

        async def back_later():
            await asyncio.sleep(0.5)  # five times the bound
            await a.start()
            restarting.clear()

        task = asyncio.ensure_future(back_later())
        assert [r.name for r in await asyncio.wait_for(rot.available(), 10)] == ["gen-0"]
        await task
        rot.mark_down(rot.replicas[0], "hung")  # not being restarted: the bound holds
        await a.stop()
        with pytest.raises(NoReplicaLeft):
            await asyncio.wait_for(rot.available(), 10)
    finally:
        await rot.close()
        await a.stop()


@pytest.mark.parametrize("up", [True, False], ids=["it-is-up", "it-failed-to-start"])
async def test_a_restart_that_ends_during_a_slow_probe_is_probed_again_before_giving_up(monkeypatch, up):
    """A probe begins while the replica is still down; before it ends (slowly: a loaded machine,
    as when CI failed so once) the supervisor has the replica up again and says its restart is
    over. The probe's answer is from before: the replica is asked once more, and that answer
    decides (in rotation, or no replica left: still bounded). The rotation's clock is frozen
    but for that probe's 30 s, so the order is the same on every run."""
    from relayrl.coordinator.clients import rotation as module

    now = [1000.0]
    monkeypatch.setattr(module, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    a = HealthServer()
    await a.start()
    restarting = {"gen-0"}
    rot = _restarting(a, restarting)
    check, probes = rot._check, []

    async def slow_check(channel):
        probes.append(now[0])
        why = await check(channel)
        if len(probes) == 1:  # the first probe: down when it asked, back (or not) when it ends
            if up:
                await a.start()
            restarting.clear()
            now[0] += 30.0
        return why

    rot._check = slow_check
    try:
        rot.mark_down(rot.replicas[0], "UNAVAILABLE: killed")
        await a.stop()
        now[0] += 0.1  # its first probe is due
        if up:
            assert [r.name for r in await asyncio.wait_for(rot.available(), 10)] == ["gen-0"]
        else:
            with pytest.raises(NoReplicaLeft):
                await asyncio.wait_for(rot.available(), 10)
        assert probes == [1000.1, 1030.1]  # the one from before, and one after the restart
    finally:
        await rot.close()
        await a.stop()


async def test_a_replica_out_of_rotation_is_probed_without_any_caller_asking():
    """A run's last steps ask for replicas only a few times: a replica marked down just after
    one of those asks must come back all the same (its probes run on a clock of their own)."""
    a, b = HealthServer(), HealthServer()
    await a.start()
    await b.start()
    admitted = []

    async def readmit(name, address):
        admitted.append(name)

    rot = await _rotation([a, b], readmit)
    try:
        rot.mark_down(rot.replicas[1], "UNAVAILABLE: killed")
        for _ in range(200):  # nobody calls available(): the clock probes it
            if rot.replicas[1].healthy:
                break
            await asyncio.sleep(0.01)
        assert rot.replicas[1].healthy and admitted == ["gen-1"]
    finally:
        await rot.close()
        await a.stop()
        await b.stop()
