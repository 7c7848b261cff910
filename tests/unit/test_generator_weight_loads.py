"""Weight loads through the generator's real code (servicer, ``VLLMEngine``'s weight swaps and
the vLLM worker extension) on a fake vLLM (``tests/kit/fake_vllm.py``).

What is checked: hostile weight-sync requests get a precise status code, never INTERNAL, and a
request refused before its first tensor leaves the replica ready at its version with its
weights; a load that failed half-way leaves it unready until a complete load, which it accepts
(over a new group too); no answer carries bytes of a file a caller named; answers carry the
version loaded and the checksums of what was loaded.
"""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
import pytest
import torch
from relayrl.common.v1 import common_pb2 as c
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.buckets import checksum, pack
from relayrl.common.weightsync.group import broadcast, master_store, open_group_with_store
from relayrl.common.weightsync.plan import plan_to_proto
from relayrl.common.weightsync.shm import ROOT, Segment
from relayrl.generator.v1 import generator_pb2 as g

from tests.kit.fake_vllm import SHAPES, plan, replica, weights
from tests.kit.net import refused_port
from tests.kit.shm_push import Staging, open_shm
from tests.kit.waits import error_of


def same(params: dict, tensors: dict) -> bool:
    return all(torch.equal(params[n], tensors[n].to(params[n].dtype)) for n in SHAPES)


async def status(stub) -> g.GetStatusResponse:
    return await stub.GetStatus(g.GetStatusRequest())


# -- a good load, and the proof of it -----------------------------------------------------------


async def test_a_shm_load_answers_the_version_and_the_checksums_of_what_was_loaded(tmp_path):
    async with replica(tmp_path) as r:
        await open_shm(r.stub)
        new = weights(1.0)
        staging = Staging(plan(new))
        try:
            sums = staging.fill(new, push_id=1)
            resp = await r.stub.UpdateWeights(staging.request(1, 1))
        finally:
            staging.seg.close()
        assert (resp.version, list(resp.bucket_checksums)) == (1, sums)
        assert same(r.params, new) and (await status(r.stub)).ready


async def test_a_push_of_the_version_held_is_done_only_with_the_same_bytes_and_an_older_one_refused(tmp_path):
    """A retried push that the first one reached after all (a broadcast peer died, the survivor
    still loaded): answered as done when it carries the bytes loaded; the same version with other
    bytes, or an older version, is refused. All take the buckets, so no sender is left waiting,
    and the weights stay."""
    async with replica(tmp_path) as r:
        await open_shm(r.stub)
        new = weights(1.0)
        staging = Staging(plan(new))
        try:
            sent = staging.fill(new, push_id=1)
            await r.stub.UpdateWeights(staging.request(2, 1))
            again = staging.fill(new, push_id=2)
            resp = await r.stub.UpdateWeights(staging.request(2, 2))
            assert again == sent and (resp.version, list(resp.bucket_checksums)) == (2, sent)
            staging.fill(weights(7.0), push_id=3)
            err = await error_of(r.stub.UpdateWeights(staging.request(2, 3)))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "other bytes" in err.details()
            assert same(r.params, new) and (await status(r.stub)).ready
            staging.fill(new, push_id=4)
            err = await error_of(r.stub.UpdateWeights(staging.request(1, 4)))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "older" in err.details()
        finally:
            staging.seg.close()
        assert (await status(r.stub)).policy_version == 2 and same(r.params, new)


async def test_load_weights_answers_a_checksum_per_tensor(tmp_path):
    async with replica(tmp_path) as r:
        new = weights(2.0)

        def stream():
            for i, (n, t) in enumerate(new.items()):
                msg = c.Tensor(name=n, dtype=c.DTYPE_FLOAT32, shape=list(t.shape), data=t.numpy().tobytes())
                yield g.LoadWeightsRequest(version=5, tensor=msg, num_tensors=len(new) if i == 0 else 0)

        resp = await r.stub.LoadWeights(stream())
        expected = [checksum(t.reshape(-1).view(torch.uint8)) for t in new.values()]
        assert (resp.version, list(resp.tensor_checksums)) == (5, expected) and same(r.params, new)


# -- hostile requests: a precise code, and nothing changed ----------------------------------


INIT_CASES = {
    "world_size 2^32-1": (
        dict(master_addr="127.0.0.1", master_port=5, world_size=2**32 - 1, rank=1, backend="gloo"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "world_size",
    ),
    "a closed port": (
        dict(master_addr="127.0.0.1", master_port=0, world_size=2, rank=1, backend="gloo", timeout_seconds=1),
        grpc.StatusCode.UNAVAILABLE,
        "could not join",
    ),
    "nccl on a CPU replica": (
        dict(master_addr="127.0.0.1", master_port=5, world_size=2, rank=1, backend="nccl"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "nccl needs GPUs",
    ),
    "rank 0": (
        dict(master_addr="127.0.0.1", master_port=5, world_size=2, rank=0, backend="gloo"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "rank 0",
    ),
}


@pytest.mark.parametrize("case", list(INIT_CASES))
async def test_hostile_init_weight_sync_gets_a_precise_code(tmp_path, case):
    fields, code, words = INIT_CASES[case]
    with refused_port() as closed:
        if fields.get("master_port") == 0:
            fields = {**fields, "master_port": closed}
        async with replica(tmp_path) as r:
            err = await error_of(r.stub.InitWeightSync(g.InitWeightSyncRequest(**fields)))
            assert err.code() == code and words in err.details(), err.details()
            assert not (await status(r.stub)).weight_sync_open


def _hostile(staging: Staging, name: str, tmp_path) -> g.UpdateWeightsRequest:
    """A request for the first version that is wrong in one way (``name``)."""
    last = staging.seg.size
    cases = {
        "a segment that does not exist": dict(segment="relayrl-t-0-nothing"),
        "an offset past the segment": dict(offsets=[*staging.offsets[:-1], last]),
        "an offset of 2^64-1": dict(offsets=[2**64 - 1, *staging.offsets[1:]]),
        "a ready table past the segment": dict(ready_offset=last),
        "a ready table at 2^64-1": dict(ready_offset=2**64 - 1),
        "a push id of 2^63": dict(push_id=2**63),
        "a push id never marked": dict(push_id=99),
    }
    if name == "version 2^64-1":
        return staging.request(2**64 - 1, 1)
    if name == "a symbolic link to a file":
        secret = tmp_path / "secret"
        secret.write_bytes(b"\x07" * 4096)
        link = ROOT / f"relayrl-t-{os.getpid()}-link"
        link.unlink(missing_ok=True)
        link.symlink_to(secret)
        return staging.request(1, 1, segment=link.name)
    return staging.request(1, 1, **cases[name])


HOSTILE = {
    "a segment that does not exist": (grpc.StatusCode.INVALID_ARGUMENT, "does not exist"),
    "a symbolic link to a file": (grpc.StatusCode.INVALID_ARGUMENT, "cannot be opened"),
    "an offset past the segment": (grpc.StatusCode.INVALID_ARGUMENT, "does not fit segment"),
    "an offset of 2^64-1": (grpc.StatusCode.INVALID_ARGUMENT, "does not fit segment"),
    "a ready table past the segment": (grpc.StatusCode.INVALID_ARGUMENT, "ready table"),
    "a ready table at 2^64-1": (grpc.StatusCode.INVALID_ARGUMENT, "ready table"),
    "a push id of 2^63": (grpc.StatusCode.INVALID_ARGUMENT, "push_id"),
    "a push id never marked": (grpc.StatusCode.UNAVAILABLE, "not complete in time"),
    "version 2^64-1": (grpc.StatusCode.INVALID_ARGUMENT, "version must be at most"),
}


@pytest.mark.parametrize("transport_only", [False, True], ids=["load", "transport-only"])
@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_shm_updates_get_a_precise_code_and_change_nothing(tmp_path, case, transport_only):
    """Each is refused before anything reaches the model: the replica keeps serving, at its
    version, with its weights (a refusal used to leave it UNAVAILABLE until the next load)."""
    code, words = HOSTILE[case]
    async with replica(tmp_path) as r:
        await open_shm(r.stub, timeout_s=0.5)  # how long a bucket whose mark never comes is waited for
        new = weights(3.0)
        staging = Staging(plan(new))
        try:
            staging.fill(new, push_id=1)
            req = _hostile(staging, case, tmp_path)
            req.transport_only = transport_only
            err = await error_of(r.stub.UpdateWeights(req))
            assert err.code() == code and words in err.details(), err.details()
            assert "\\x07" not in err.details() and str(0x0707070707070707) not in err.details()
            st = await status(r.stub)
            assert (st.ready, st.policy_version) == (True, 0) and not any(p.any() for p in r.params.values())
            resp = await r.stub.UpdateWeights(staging.request(1, 1))  # and a good load still works
            assert resp.version == 1 and same(r.params, new)
        finally:
            staging.seg.close()
            (ROOT / f"relayrl-t-{os.getpid()}-link").unlink(missing_ok=True)


async def test_a_bucket_that_differs_from_its_ready_table_checksum_is_data_loss_and_not_loaded(tmp_path):
    async with replica(tmp_path) as r:
        await open_shm(r.stub)
        new = weights(4.0)
        staging = Staging(plan(new))
        try:
            staging.fill(new, push_id=1)
            staging.table.mark(0, 1, 12345)  # bucket 0's bytes no longer match what the table says
            err = await error_of(r.stub.UpdateWeights(staging.request(1, 1)))
            assert err.code() == grpc.StatusCode.DATA_LOSS and "does not match the checksum" in err.details()
            st = await status(r.stub)
            assert (st.ready, st.policy_version) == (True, 0)  # bucket 0 failed: nothing was loaded
            assert not r.params["a.weight"].any()
        finally:
            staging.seg.close()


async def test_integer_tensors_for_float_weights_are_refused_naming_the_tensor(tmp_path):
    async with replica(tmp_path) as r:
        await open_shm(r.stub)
        new = weights(5.0) | {"b.weight": weights(5.0)["b.weight"].to(torch.int64)}
        staging = Staging(plan(new))
        try:
            staging.fill(new, push_id=1)
            err = await error_of(r.stub.UpdateWeights(staging.request(1, 1)))
        finally:
            staging.seg.close()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "b.weight: dtype int64" in err.details()
        assert (await status(r.stub)).ready and not r.params["a.weight"].any()


async def test_a_probe_error_never_says_what_the_segment_holds(tmp_path):
    async with replica(tmp_path) as r:
        probe = Segment.create(64, "t")
        try:
            probe.write(0, (0x5EC2E7).to_bytes(8, "little"))
            req = g.InitWeightSyncRequest(
                transport=g.WEIGHT_TRANSPORT_SHM, shm_probe=probe.name, probe_checksum=1
            )
            err = await error_of(r.stub.InitWeightSync(req))
        finally:
            probe.close()
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and str(0x5EC2E7) not in err.details()


# -- failures half-way, and coming back --------------------------------------------------------


async def test_a_segment_truncated_during_a_load_fails_it_and_the_next_load_restores_the_replica(tmp_path):
    """The learner (or anyone with its user) truncates the segment while the replica waits for
    bucket 1: bucket 0 is loaded, so the replica serves nothing until a complete load."""
    async with replica(tmp_path) as r:
        await open_shm(r.stub)
        new = weights(6.0)
        staging = Staging(plan(new))
        try:
            staging.fill(new, push_id=1, upto=1)
            call = asyncio.ensure_future(r.stub.UpdateWeights(staging.request(1, 1)))
            while not r.params["a.weight"].any():  # bucket 0 is in: the replica waits for bucket 1
                await asyncio.sleep(0.01)
            os.truncate(ROOT / staging.seg.name, 8)
            err = await error_of(call)
            assert err.code() == grpc.StatusCode.DATA_LOSS and "truncated" in err.details()
            assert not (await status(r.stub)).ready
        finally:
            staging.seg.close()
        staging = Staging(plan(new))
        try:
            staging.fill(new, push_id=2)
            assert (await r.stub.UpdateWeights(staging.request(1, 2))).version == 1
        finally:
            staging.seg.close()
        assert (await status(r.stub)).ready and same(r.params, new)


async def test_an_error_inside_vllms_loader_does_not_brick_the_replica(tmp_path):
    async with replica(tmp_path) as r:
        await open_shm(r.stub)
        r.worker.loader_fails_at = "b.weight"
        new = weights(7.0)
        staging = Staging(plan(new))
        try:
            staging.fill(new, push_id=1)
            err = await error_of(r.stub.UpdateWeights(staging.request(1, 1)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "the loader failed" in err.details()
            assert not (await status(r.stub)).ready
            r.worker.loader_fails_at = None
            staging.fill(new, push_id=2)
            assert (await r.stub.UpdateWeights(staging.request(1, 2))).version == 1
        finally:
            staging.seg.close()
        assert (await status(r.stub)).ready and same(r.params, new)


async def _join(stub, timeout_s: float = 60):
    """The learner's side of a gloo group with this replica (rank 0 here, in a thread), its store
    on a port the kernel picked as the learner's is (``master_store``: a port found free and
    bound later was taken meanwhile under load, EADDRINUSE)."""
    master = await asyncio.to_thread(master_store, "127.0.0.1", 2, timeout_s)
    port = master.port
    init = asyncio.ensure_future(
        stub.InitWeightSync(
            g.InitWeightSyncRequest(
                transport=g.WEIGHT_TRANSPORT_GLOO, master_addr="127.0.0.1", master_port=port, world_size=2, rank=1,
                timeout_seconds=timeout_s,
            )
        )
    )  # fmt: skip
    pg, store = await asyncio.to_thread(
        open_group_with_store, "127.0.0.1", port, 2, 0, "gloo", timeout_s, store=master
    )
    await init
    return pg, store


async def test_a_replica_broken_by_a_push_its_peer_broke_takes_the_next_complete_push_over_a_new_group(
    tmp_path,
):
    """What the e2e restart test does to the surviving replica: its push breaks half-way (the
    learner abandons it when another member dies), so it serves nothing; the learner closes
    the group, opens a new one with it and pushes the whole plan: it serves again."""
    async with replica(tmp_path) as r:
        new = weights(8.0)
        buckets = plan(new)
        pg, store = await _join(r.stub)
        call = asyncio.ensure_future(
            r.stub.UpdateWeights(g.UpdateWeightsRequest(version=1, plan=plan_to_proto(buckets)))
        )
        first = pack(buckets[0], [new[m.name] for m in buckets[0].tensors])
        await asyncio.to_thread(broadcast, pg, first)
        groupwait.abandon(store)  # the learner lost the other member
        err = await error_of(call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "half-way" in err.details()
        st = await status(r.stub)
        assert (st.ready, st.policy_version) == (False, 0)
        groupwait.release([pg], False, 70)
        await r.stub.CloseWeightSync(g.CloseWeightSyncRequest())
        pg, store = await _join(r.stub)  # the learner's retry: a new group, the full plan
        call = asyncio.ensure_future(
            r.stub.UpdateWeights(g.UpdateWeightsRequest(version=1, plan=plan_to_proto(buckets)))
        )
        for b in buckets:
            await asyncio.to_thread(broadcast, pg, pack(b, [new[m.name] for m in b.tensors]))
        resp = await call
        st = await status(r.stub)
        assert (resp.version, st.ready, st.policy_version) == (1, True, 1) and same(r.params, new)
        groupwait.release([pg], False, 70)
        await r.stub.CloseWeightSync(g.CloseWeightSyncRequest())


async def test_a_push_held_up_while_its_group_was_replaced_leaves_the_new_groups_broadcast_alone(tmp_path):
    """The e2e kill-in-training case: a push reaches the replica, whose swap waits on vLLM's
    pause; meanwhile the learner gives that push up (a peer died), closes the group, opens a new
    one and sends the retry. The held-up push's receive then ran on the new group and took the
    retry's broadcast; the retry's own UpdateWeights, waiting behind it, waited for a broadcast
    that never came (the learner sends once) until the group's timeout. Now it is refused."""
    async with replica(tmp_path) as r:
        new = weights(3.0)
        buckets = plan(new)
        request = g.UpdateWeightsRequest(version=1, plan=plan_to_proto(buckets))
        paused, resume, retried = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def pause_generation(mode="abort", clear_cache=True):
            paused.set()
            await resume.wait()

        update, seen = r.engine.update_weights, []

        async def update_weights(*args, **kwargs):
            seen.append(args)
            if len(seen) == 2:
                retried.set()  # it runs on to the swap lock the first push holds
            return await update(*args, **kwargs)

        r.engine._llm.pause_generation, r.engine.update_weights = pause_generation, update_weights
        pg, store = await _join(r.stub)
        first = asyncio.ensure_future(r.stub.UpdateWeights(request))
        await asyncio.wait_for(paused.wait(), 30)
        groupwait.abandon(store)  # the learner gives the push up and leaves the group
        groupwait.release([pg], False, 70)
        await r.stub.CloseWeightSync(g.CloseWeightSyncRequest())
        pg, store = await _join(r.stub, timeout_s=10)  # the retry's group
        retry = asyncio.ensure_future(r.stub.UpdateWeights(request))
        await asyncio.wait_for(retried.wait(), 30)
        resume.set()
        packed = [pack(b, [new[m.name] for m in b.tensors]) for b in buckets]
        for buf in packed:  # the retry's broadcast, sent once
            await asyncio.to_thread(broadcast, pg, buf)
        resp = await retry  # before: UNAVAILABLE at the group's timeout (10 s)
        assert (resp.version, list(resp.bucket_checksums)) == (1, [checksum(b) for b in packed])
        err = await error_of(first)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "sent on is closed" in err.details()
        st = await status(r.stub)
        assert (st.ready, st.policy_version) == (True, 1) and same(r.params, new)
        groupwait.release([pg], False, 15)
        await r.stub.CloseWeightSync(g.CloseWeightSyncRequest())


async def test_a_call_into_a_dead_engine_that_ignores_cancellation_is_given_up(monkeypatch):
    """``asyncio.wait_for`` waits for a cancelled call to end: one into a dead EngineCore may
    never end. ``within`` gives up on it."""
    from relayrl.common.rpc import Unavailable
    from relayrl.generator.engine import within

    release = threading.Event()

    async def deaf():
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # as a call stuck on a dead peer's socket: cancellation does not end it

    try:
        with pytest.raises(Unavailable, match="aborting r1 did not return within"):
            await asyncio.wait_for(within(deaf(), 0.05, "aborting r1"), 30)
    finally:
        release.set()


async def test_weight_calls_before_the_engine_runs_are_unavailable(tmp_path):
    """The server answers while vLLM still loads (live, not ready): weight calls then met an
    engine that was not there (INTERNAL)."""
    async with replica(tmp_path) as r:
        llm, r.engine._llm = r.engine._llm, None
        try:
            req = g.InitWeightSyncRequest(
                master_addr="127.0.0.1", master_port=5, world_size=2, rank=1, backend="gloo"
            )
            err = await error_of(r.stub.InitWeightSync(req))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "not running" in err.details()
        finally:
            r.engine._llm = llm
