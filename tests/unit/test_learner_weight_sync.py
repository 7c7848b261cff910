"""Rank 0's weight sync against replicas that misbehave: the learner's real servicer and
``WeightSync`` on a real gRPC server, a core that trains and gathers nothing (it sends fixed
weights), generators that are either the real generator code on a fake vLLM
(``tests/kit/fake_vllm.py``) or stand-ins that refuse, never answer, or answer wrong.

What is checked: one replica never holds TrainStep (not while it registers, not while it loads);
a refusal to join ends a registration at once; a replica silent after a push is named and the
push ends; an answer that is not what was sent is DATA_LOSS naming the replica; a registration
whose caller gave up does nothing; after a member of a group dies mid-push, the retried push
reaches the survivor, which serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from relayrl.common.grpc_server import create_server, start
from relayrl.common.placement import host_id
from relayrl.common.rpc import DeadlineExceeded, FailedPrecondition
from relayrl.common.weightsync.buckets import checksum
from relayrl.common.weightsync.plan import TensorMeta, plan_buckets
from relayrl.common.weightsync.shm import Reader, ReadyTable
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner.config import LearnerConfig
from relayrl.learner.push import send_buckets
from relayrl.learner.servicer import LearnerServicer
from relayrl.learner.sync import WeightSync
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

from tests.kit.fake_vllm import BUCKET, SHAPES, replica, weights
from tests.kit.waits import until

METAS = [TensorMeta(n, "float32", s) for n, s in SHAPES.items()]
METRICS = ("loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "step_seconds")


class FakeCore:
    """Rank 0's core without DeepSpeed: a step bumps the version; a push sends ``weights(version)``."""

    role = "actor"

    def __init__(self):
        self.trainer = SimpleNamespace(step=0, version=0, cfg=LearnerConfig(), world_size=1)

    def require(self, *roles, what=""):
        pass

    def train(self, request, max_tokens):
        self.trainer.step += 1
        self.trainer.version += 1
        return {**dict.fromkeys(METRICS, 0.0), "tokens": 1, "samples": 1}

    def push(self, buckets, sinks, transport_only=False):
        w = weights(float(self.trainer.version))
        return send_buckets(buckets, ([w[m.name] for m in b.tensors] for b in buckets), sinks)


def weight_sync(transport: str, timeout_s: float = 300.0, deadline_s: float = 600.0) -> WeightSync:
    return WeightSync(
        "127.0.0.1", "cpu", "float32", timeout_s, deadline_s, lambda dtype: METAS, transport=transport
    )


@contextlib.asynccontextmanager
async def learner(tmp_path, sync: WeightSync):
    servicer = LearnerServicer(FakeCore(), sync, bucket_bytes=BUCKET, max_tokens=0, checkpoint_dir=tmp_path)
    handle = create_server(servicer, lp.DESCRIPTOR.services_by_name["LearnerService"])
    await start(handle, ready=True)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield lg.LearnerServiceStub(ch)
    finally:
        await ch.close()
        await handle.stop(0)
        sync.close()


class StandIn(gg.GeneratorServiceServicer):
    """A replica on this host that answers GetStatus and CloseWeightSync, and does ``init`` at
    InitWeightSync ("refuse", "hang", "ok") and ``update`` at UpdateWeights ("hang", or
    "other-version": reads the buckets right but says it holds another version)."""

    def __init__(self, init: str = "ok", update: str = "hang"):
        self.init, self.update = init, update
        self.called = {"init": asyncio.Event(), "update": asyncio.Event()}

    async def GetStatus(self, request, context):
        return g.GetStatusResponse(host_id=host_id(), device="cpu", weight_sync_ranks=1, ready=True)

    async def CloseWeightSync(self, request, context):
        return g.CloseWeightSyncResponse()

    async def InitWeightSync(self, request, context):
        self.called["init"].set()
        if self.init == "refuse":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this replica refuses")
        if self.init == "hang":
            await asyncio.Event().wait()
        return g.InitWeightSyncResponse(transport=request.transport)

    async def UpdateWeights(self, request, context):
        self.called["update"].set()
        if self.update == "hang":
            await asyncio.Event().wait()
        sums = await asyncio.to_thread(_read_checksums, request)
        return g.UpdateWeightsResponse(version=request.version + 1, bucket_checksums=sums)


def _read_checksums(request: g.UpdateWeightsRequest) -> list[int]:
    seg = Reader.open(request.shm.segment)
    try:
        table = ReadyTable(seg, request.shm.ready_offset, len(request.plan.buckets))
        sums = []
        for i, (b, o) in enumerate(zip(request.plan.buckets, request.shm.offsets, strict=True)):
            table.wait(i, request.shm.push_id, time.monotonic() + 30)
            buf = torch.empty(b.nbytes, dtype=torch.uint8)
            seg.read_into(o, buf)
            sums.append(checksum(buf))
        return sums
    finally:
        seg.close()


@contextlib.asynccontextmanager
async def stand_in(**behaviour):
    server = grpc.aio.server()
    fake = StandIn(**behaviour)
    gg.add_GeneratorServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def registered(stub) -> list[str]:
    return [x.replica_id for x in (await stub.GetStatus(lp.GetStatusRequest())).generators]


# -- registration ------------------------------------------------------------------------------


async def test_a_replica_that_refuses_to_join_the_group_ends_its_registration_at_once():
    """It refused at once; the learner went on waiting for it to join for the group's timeout
    (weight_sync_timeout_seconds, 300 s), with the lock TrainStep needs."""
    sync = weight_sync("gloo", timeout_s=300)
    async with stand_in(init="refuse") as (_, address):
        with pytest.raises(FailedPrecondition, match="gen-x: FAILED_PRECONDITION this replica refuses"):
            await asyncio.wait_for(sync.register("gen-x", address), 60)
    assert sync.replica_ids() == [] and sync.groups == {}


async def test_a_training_step_does_not_wait_for_a_registration_and_a_cancelled_one_is_undone(tmp_path):
    sync = weight_sync("gloo")
    async with stand_in(init="hang") as (fake, address), learner(tmp_path, sync) as stub:
        call = stub.RegisterGenerator(lp.RegisterGeneratorRequest(replica_id="gen-x", address=address))
        await asyncio.wait_for(fake.called["init"].wait(), 30)  # registering: the replica does not answer
        step = await stub.TrainStep(lp.TrainStepRequest(step=1), timeout=30)
        assert step.step == 1
        call.cancel()  # the caller gives up: the registration goes with it
        # polled where GetStatus reads it: its generators are sync's members (until takes a plain predicate)
        await until(
            lambda: "gen-x" not in sync.replica_ids() and not sync.lock.locked(),
            30,
            0.05,
            "the cancelled registration stayed",
        )
        assert await registered(stub) == [] and sync.groups == {}


async def test_a_registration_or_unregistration_whose_caller_gave_up_does_nothing():
    sync = weight_sync("shm")
    async with stand_in() as (_, address):
        with pytest.raises(DeadlineExceeded, match="nothing was done"):
            await sync.register("gen-x", address, deadline=time.monotonic() - 1)
        async with sync.lock:  # a push under way: the registration waits for its turn...
            waiting = asyncio.ensure_future(sync.register("gen-x", address))
            await asyncio.sleep(0)
            waiting.cancel()  # ...and its caller leaves meanwhile
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert sync.replica_ids() == []
        assert await sync.register("gen-x", address) == "shm"
        with pytest.raises(DeadlineExceeded):
            await sync.unregister("gen-x", deadline=time.monotonic() - 1)
        assert sync.replica_ids() == ["gen-x"]


# -- pushes ------------------------------------------------------------------------------------


async def test_a_replica_silent_after_a_push_is_named_the_others_load_and_training_goes_on(tmp_path):
    """A registered replica that never answers UpdateWeights held TrainStep for the learner's
    call deadline (rpc_deadline_seconds, 600 s). Now the push waits for answers only after the
    gather + send, at most weight_sync_timeout_seconds, names the silent one, and writes the
    next push into fresh shared memory (the silent one may still be reading this one)."""
    sync = weight_sync("shm", timeout_s=3, deadline_s=600)
    async with (
        replica(tmp_path, "gen-good") as good,
        stand_in(update="hang") as (silent, address),
        learner(tmp_path, sync) as stub,
    ):
        await stub.RegisterGenerator(lp.RegisterGeneratorRequest(replica_id="gen-good", address=good.address))
        await stub.RegisterGenerator(lp.RegisterGeneratorRequest(replica_id="gen-silent", address=address))
        await stub.TrainStep(lp.TrainStepRequest(step=1), timeout=30)
        push = stub.PushWeights(lp.PushWeightsRequest(version=1))
        await asyncio.wait_for(silent.called["update"].wait(), 30)
        assert (await stub.TrainStep(lp.TrainStepRequest(step=2), timeout=30)).step == 2
        segment = sync.kinds["shm"]._segment.name
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(push, 60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "gen-silent: no answer within 3 s" in e.value.details() and "gen-good" not in e.value.details()
        st = await good.stub.GetStatus(g.GetStatusRequest())
        assert (st.ready, st.policy_version) == (True, 1)
        assert all(torch.equal(good.params[n], t) for n, t in weights(1.0).items())
        assert sync.kinds["shm"]._segment is None or sync.kinds["shm"]._segment.name != segment


async def test_an_answer_naming_another_version_is_data_loss_naming_the_replica(tmp_path):
    sync = weight_sync("shm")
    async with stand_in(update="other-version") as (_, address), learner(tmp_path, sync) as stub:
        await stub.RegisterGenerator(lp.RegisterGeneratorRequest(replica_id="gen-liar", address=address))
        await stub.TrainStep(lp.TrainStepRequest(step=1), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.PushWeights(lp.PushWeightsRequest(version=1), timeout=60)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS
        assert "gen-liar: it answered version 2, not 1" in e.value.details()
        assert (await stub.GetStatus(lp.GetStatusRequest())).generators[0].policy_version == 0


_MEMBER = """
import os, sys, torch
from relayrl.common.weightsync.group import broadcast, open_group_with_store
port, world, rank, nbytes = (int(a) for a in sys.argv[1:])
pg = open_group_with_store("127.0.0.1", port, world, rank, "gloo", 60)
print("joined", flush=True)
sys.stdin.readline()  # a push begins
broadcast(pg, torch.empty(nbytes, dtype=torch.uint8))
os._exit(1)  # killed after its first bucket, as the e2e test kills gen-1
"""


class DyingMember(StandIn):
    """A replica whose worker is a process of its own: it joins the group, takes the first
    bucket of the next push and dies (its sockets close, as a killed generator's do)."""

    def __init__(self):
        super().__init__()
        self.proc = None

    async def InitWeightSync(self, request, context):
        import sys

        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _MEMBER, str(request.master_port), str(request.world_size), str(request.rank),
            str(plan_buckets(METAS, BUCKET)[0].nbytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert (await self.proc.stdout.readline()).strip() == b"joined"
        return g.InitWeightSyncResponse(transport=request.transport, rank=request.rank, num_ranks=1)

    async def UpdateWeights(self, request, context):
        self.proc.stdin.write(b"go\n")
        await self.proc.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "killed")


async def test_after_a_group_member_dies_mid_push_the_retried_push_restores_the_survivor(tmp_path):
    """The e2e restart test's gloo case: gen-1 dies while the learner broadcasts version 2 to
    gen-0 and gen-1. The push fails; gen-0 either got every bucket (it serves version 2) or was
    abandoned half-way (it serves nothing). The coordinator then forgets gen-1 and registers
    gen-0 again (a live replica that is not ready is readmitted); the retried push forms a new
    group with gen-0 alone and gen-0 serves version 2. Nothing stays locked on the learner."""
    sync = weight_sync("gloo", timeout_s=60)
    async with (
        replica(tmp_path, "gen-0") as r0,
        learner(tmp_path, sync) as stub,
    ):
        server = grpc.aio.server()
        dying = DyingMember()
        gg.add_GeneratorServiceServicer_to_server(dying, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            await stub.TrainStep(lp.TrainStepRequest(step=1), timeout=30)
            for rid, addr in (("gen-0", r0.address), ("gen-1", address)):
                reg = lp.RegisterGeneratorRequest(replica_id=rid, address=addr)
                assert (await stub.RegisterGenerator(reg, timeout=60)).transport == "gloo"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.PushWeights(lp.PushWeightsRequest(version=1), timeout=120)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
            # polled where GetStatus reads it: the engine's status().swapping
            await until(
                lambda: not r0.engine.status().swapping,
                60,
                0.05,
                "gen-0's swap did not end (the learner abandons the push)",
            )
            st = await r0.stub.GetStatus(g.GetStatusRequest())
            assert not st.swapping and (st.ready, st.policy_version) in ((False, 0), (True, 1))

            await stub.UnregisterGenerator(lp.UnregisterGeneratorRequest(replica_id="gen-1"), timeout=60)
            reg = lp.RegisterGeneratorRequest(replica_id="gen-0", address=r0.address)
            assert (await stub.RegisterGenerator(reg, timeout=60)).transport == "gloo"
            await stub.PushWeights(lp.PushWeightsRequest(version=1), timeout=120)
            st = await r0.stub.GetStatus(g.GetStatusRequest())
            assert (st.ready, st.policy_version) == (True, 1)
            assert all(torch.equal(r0.params[n], t) for n, t in weights(1.0).items())
            assert not sync.lock.locked() and set(sync.groups["gloo"].members) == {"gen-0"}
        finally:
            if dying.proc is not None and dying.proc.returncode is None:
                dying.proc.kill()
            await server.stop(0)


async def test_members_that_joined_beside_a_refusing_one_are_not_left_waiting(tmp_path):
    """gen-0 is in the gloo group; gen-x registers and refuses to join the group re-formed with
    both. gen-0 had joined: inside gloo's rendezvous its engine (one call at a time) would wait
    for gen-x's rank until the group's timeout (300 s), and the next push could not re-form the
    group with it. The learner takes the absent rank itself, so gen-0 is free at once."""
    sync = weight_sync("gloo", timeout_s=300)
    async with (
        replica(tmp_path, "gen-0") as r0,
        stand_in(init="refuse") as (_, address),
        learner(tmp_path, sync) as stub,
    ):
        reg = lp.RegisterGeneratorRequest(replica_id="gen-0", address=r0.address)
        assert (await stub.RegisterGenerator(reg, timeout=60)).transport == "gloo"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.RegisterGenerator(
                lp.RegisterGeneratorRequest(replica_id="gen-x", address=address), timeout=60
            )
        assert (
            e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "this replica refuses" in e.value.details()
        )
        await stub.TrainStep(lp.TrainStepRequest(step=1), timeout=30)
        resp = await stub.PushWeights(lp.PushWeightsRequest(version=1), timeout=60)
        assert list(resp.replica_ids) == ["gen-0"] and await registered(stub) == ["gen-0"]
        assert all(torch.equal(r0.params[n], t) for n, t in weights(1.0).items())


@pytest.mark.parametrize("transport", ["shm", "gloo"])
async def test_a_replica_restarted_between_two_pushes_is_opened_again_not_a_failed_push(tmp_path, transport):
    """A generator killed and started again at its address while the learner trains (its
    supervisor was quick; no Generate has touched it yet): the learner still has it registered,
    but the new process has no weight sync open. Its next push must reopen it and bring it to
    the current version, not fail the run with "weight sync is not open"."""
    sync = weight_sync(transport, timeout_s=30)
    async with replica(tmp_path, "gen-0") as gen, learner(tmp_path, sync) as stub:
        await stub.RegisterGenerator(lp.RegisterGeneratorRequest(replica_id="gen-0", address=gen.address))
        await stub.TrainStep(lp.TrainStepRequest(step=1), timeout=30)
        await stub.PushWeights(lp.PushWeightsRequest(version=1), timeout=60)
        await gen.stub.CloseWeightSync(g.CloseWeightSyncRequest())  # what a new process looks like
        await stub.TrainStep(lp.TrainStepRequest(step=2), timeout=30)
        pushed = await stub.PushWeights(lp.PushWeightsRequest(version=2), timeout=60)
        assert list(pushed.replica_ids) == ["gen-0"]
        st = await gen.stub.GetStatus(g.GetStatusRequest())
        assert (st.ready, st.policy_version, st.weight_sync_open) == (True, 2, True)
        assert all(torch.equal(gen.params[n], t) for n, t in weights(2.0).items())
