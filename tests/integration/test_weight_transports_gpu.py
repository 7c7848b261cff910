"""CUDA IPC between two processes on one GPU (marked ``gpu``; ``scripts/gpu_check.sh`` runs it):
the fields ``relayrl.common.weightsync.cudaipc.share`` puts on the wire rebuild the same memory in
another process, and the bytes read there are the bytes written here; a push staged in one
shared buffer reaches a receiver that reads each bucket's window as the ready table marks it.

The receivers run in a fresh process each (``tests.kit.child.run_child``): one that fails says
why in the test's message, its traceback included, and one that hangs is killed at a bound.
This file failed on an H200 with "the receiver never answered": the receiver asked for
``torch.cuda.get_device_properties(0).uuid.hex``, an attribute torch's ``_CUuuid`` does not have
(it has ``bytes`` and ``str()``), and died of the AttributeError before putting its answer on the
queue the test waited 120 s on; its traceback went to a stderr nobody showed."""

from __future__ import annotations

import dataclasses

import pytest

from tests.kit.child import run_child

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
HERE = "tests.integration.test_weight_transports_gpu"
CHILD_S = 120  # a fresh process opens its first CUDA IPC handle in ~4 s on an H200


def receive(fields: dict) -> dict:
    """The receiver: open the shared buffer on this process's device 0 and read it."""
    import torch
    from relayrl.common.placement import gpu_uuid
    from relayrl.common.weightsync.buckets import checksum
    from relayrl.common.weightsync.cudaipc import Shared, open_shared

    torch.cuda.set_device(0)
    buf = open_shared(Shared(**fields), 0)
    return {"checksum": checksum(buf), "nbytes": buf.numel(), "uuid": gpu_uuid(0)}


def test_a_shared_buffer_reads_the_same_in_another_process_on_the_same_gpu():
    import torch
    from relayrl.common.placement import gpu_uuid
    from relayrl.common.weightsync.buckets import checksum
    from relayrl.common.weightsync.cudaipc import share

    buf = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    fields = dataclasses.asdict(share(buf))
    assert all(isinstance(v, bytes | int | bool) for v in fields.values())  # plain data, no pickle
    got = run_child(f"{HERE}:receive", {"fields": fields}, CHILD_S)
    assert got == {"checksum": checksum(buf), "nbytes": buf.numel(), "uuid": gpu_uuid(0)}


def receive_push(plan: list, windows: list, segment: str, push_id: int) -> dict:
    """A generator's IPC read (``worker_ext.ipc_sources``): each bucket's window of the learner's
    one staging buffer, taken once the ready table marks it; checksums computed on the GPU and
    read back once."""
    import time

    import torch
    from relayrl.common.weightsync import buckets as bk
    from relayrl.common.weightsync.cudaipc import Shared, open_shared
    from relayrl.common.weightsync.plan import plan_from_plain
    from relayrl.common.weightsync.shm import ReadyTable, Segment
    from relayrl.generator.worker_ext import ipc_sources

    torch.cuda.set_device(0)
    reads = []
    read = bk.read_checksums
    bk.read_checksums = lambda t: reads.append(t.numel()) or read(t)
    buckets = plan_from_plain(plan)
    bufs = [open_shared(Shared(**w), 0) for w in windows]
    seg = Segment.attach(segment)
    try:
        ready = (ReadyTable(seg, 0, len(buckets)), push_id, time.monotonic() + CHILD_S)
        sums = bk.Sums()
        for _b, buf, _ in ipc_sources(buckets, bufs, ready):
            sums.add(buf)
        return {"checksums": sums.read(), "reads": reads}
    finally:
        seg.close()


def test_a_push_staged_in_one_buffer_reaches_a_receiver_reading_windows_as_they_are_marked():
    import concurrent.futures

    import torch
    from relayrl.common.weightsync import buckets as bk
    from relayrl.common.weightsync.cudaipc import share, window
    from relayrl.common.weightsync.plan import TensorMeta, aligned, plan_buckets, plan_to_plain
    from relayrl.common.weightsync.shm import ReadyTable, Segment
    from relayrl.learner.push import Sinks, send_buckets

    metas = [TensorMeta(f"w{i}", "bfloat16", (1024, 1000 + i)) for i in range(12)]
    metas += [TensorMeta("norm", "float32", (1001,)), TensorMeta("big", "bfloat16", (9000, 1024))]
    params = {m.name: torch.randn(m.shape, device="cuda:0").to(bk.torch_dtype(m.dtype)) for m in metas}
    buckets = plan_buckets(metas, 6 << 20)
    assert len(buckets) > 2
    staging = bk.Staging(buckets, device="cuda:0")
    whole = share(staging.buf)
    windows = [
        dataclasses.asdict(window(whole, o, b.nbytes)) for b, o in zip(buckets, staging.offsets, strict=True)
    ]
    seg = Segment.create(aligned(len(buckets) * ReadyTable.ENTRY), "t")
    try:
        table = ReadyTable(seg, 0, len(buckets))
        args = {"plan": plan_to_plain(buckets), "windows": windows, "segment": seg.name, "push_id": 1}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            child = pool.submit(run_child, f"{HERE}:receive_push", args, CHILD_S)
            items = ([params[m.name] for m in b.tensors] for b in buckets)
            marks = Sinks(ipc=staging, on_ipc_ready=lambda i: table.mark(i, 1, 0))
            _, sums = send_buckets(buckets, items, marks)
            got = child.result(timeout=CHILD_S + 10)
        packed = [bk.checksum(bk.pack(b, [params[m.name] for m in b.tensors], "cuda:0")) for b in buckets]
        assert sums == packed  # the staging holds the bytes the old packing made
        assert got["checksums"] == sums  # and the receiver read exactly those
        assert got["reads"] == [len(buckets)]  # its checksums came back in one read
    finally:
        seg.close()
