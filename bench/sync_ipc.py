"""CUDA IPC weight push to a receiver on the same GPU, the 0.5B shape; first, on any machine, a
check of the staging such a push goes through.

    python bench/sync_ipc.py [--repeats 10] [--bucket-mb 256] [--dtype bfloat16] [--cpu-size 10m]

The check (CPU, a ``--cpu-size`` model of ``bench/learner.py``'s shapes): relayrl's own push code
(``push.send_buckets`` into a ``buckets.Staging``: one buffer, a view per bucket, each bucket
filled in one batched copy, checksums computed where the bucket is and read once) marks each
bucket in a ready table as it is staged, while a generator's own IPC read path
(``worker_ext.ipc_sources`` and ``_relayrl_take``, in a thread) takes each bucket as it is marked.
The sender stages bucket i+1 only once the receiver has read bucket i, so a receiver that waited
for the whole push would stall it (``ipc_receiver_overlaps: 0``). Reads of checksum values are
counted where they happen (``buckets.read_checksums``).

The push (CUDA only): the parameters of a Qwen2.5-0.5B-shaped model (on the GPU, in ``--dtype``)
are planned into buckets and staged into one CUDA buffer shared once (``cudaipc.share``; the
receiver gets a window per bucket, as the learner's IPC transport does). The receiver, another
process on the same GPU, is told a push began, takes each bucket as the ready table marks it,
copies its tensors into its own parameters (what a generator's load does, minus vLLM's weight
loaders) and checksums it; the push ends when it answers. Baseline: a device-to-device copy of
the same bytes in one process. Target there: ``ipc_push_vs_copy_ratio`` <= 4.

Last, ``name: value`` lines: ``ipc_staging_bytes_equal`` (every staged bucket holds the bytes the
old tensor-by-tensor packing made, and the receiver's checksums are the sender's),
``ipc_receiver_overlaps``, ``ipc_receiver_checksum_reads_per_push``, ``ipc_checksum_reads_per_push``
(the sender's; target 1, was one per bucket), then with CUDA the same for the push there
(``ipc_gpu_*``) and, last, ``ipc_push_vs_copy_ratio``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table

WAIT_S = 30.0  # at most, for the other side of a push (a stalled one shows as a failed check)


def metas(dtype: str, size: str = "0.5b") -> list:
    """Names and shapes of a ``bench/learner.py`` model's parameters (tied embeddings), from a
    model on the meta device: nothing is allocated."""
    import torch
    from relayrl.common.weightsync.plan import TensorMeta
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.learner import SHAPES

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size][0], tie_word_embeddings=True))
    return [TensorMeta(n, dtype, tuple(p.shape)) for n, p in model.named_parameters()]


class Reads:
    """Counts ``buckets.read_checksums`` calls per thread (the sender's, the receiver's)."""

    def __init__(self) -> None:
        from relayrl.common.weightsync import buckets

        self.by_thread: dict[str, int] = {}
        self._module, self._read = buckets, buckets.read_checksums

        def counted(values):
            name = threading.current_thread().name
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
            return self._read(values)

        buckets.read_checksums = counted

    def take(self, name: str) -> int:
        return self.by_thread.pop(name, 0)

    def close(self) -> None:
        self._module.read_checksums = self._read


def cpu_check(size: str, bucket_bytes: int, dtype: str, pushes: int = 2) -> dict[str, float]:
    """The staging check on the CPU (see the module docstring); its ``name: value`` figures."""
    import torch
    from relayrl.common.weightsync.buckets import Staging, checksum, pack, torch_dtype
    from relayrl.common.weightsync.plan import aligned, plan_buckets
    from relayrl.common.weightsync.shm import ReadyTable, Segment
    from relayrl.generator.worker_ext import WeightSyncExtension, ipc_sources
    from relayrl.learner.push import Sinks, send_buckets

    plan = metas(dtype, size)
    buckets = plan_buckets(plan, bucket_bytes)
    gen = torch.Generator().manual_seed(0)
    params = {m.name: torch.randn(m.shape, generator=gen).to(torch_dtype(dtype)) for m in plan}
    tensors = [[params[m.name] for m in b.tensors] for b in buckets]
    staging = Staging(buckets)
    seg = Segment.create(aligned(len(buckets) * ReadyTable.ENTRY), "bench")
    table = ReadyTable(seg, 0, len(buckets))
    reads = Reads()
    equal, overlaps, sender_reads, receiver_reads = True, True, [], []
    try:
        for push_id in range(1, pushes + 1):
            progress: queue.Queue = queue.Queue()
            answer: list = []

            def sources(push_id=push_id, progress=progress):
                ready = (table, push_id, time.monotonic() + WAIT_S)
                for i, got in enumerate(ipc_sources(buckets, staging.views, ready)):
                    yield got
                    progress.put(i)  # the receiver has this bucket: the sender may go on

            def receive(sources=sources, answer=answer):
                answer.append(WeightSyncExtension()._relayrl_take(buckets, sources(), False))

            receiver = threading.Thread(target=receive, name="receiver")
            receiver.start()

            def items(progress=progress):
                nonlocal overlaps
                for i, ts in enumerate(tensors):
                    if i:
                        try:
                            overlaps &= progress.get(timeout=WAIT_S) == i - 1
                        except queue.Empty:
                            overlaps = False
                    yield ts

            marks = Sinks(ipc=staging, on_ipc_ready=lambda i, push_id=push_id: table.mark(i, push_id, 0))
            reads.take("MainThread")  # the sender's reads of this push only
            _, sums = send_buckets(buckets, items(), marks)
            receiver.join(WAIT_S)
            sender_reads.append(reads.take("MainThread"))
            receiver_reads.append(reads.take("receiver"))
            packed = [pack(b, ts) for b, ts in zip(buckets, tensors, strict=True)]
            equal &= all(torch.equal(v, p) for v, p in zip(staging.views, packed, strict=True))
            equal &= bool(answer) and answer[0]["checksums"] == sums == [checksum(p) for p in packed]
    finally:
        reads.close()
        seg.close()
    return {  # the headline last
        "ipc_cpu_check_buckets": len(buckets),
        "ipc_staging_bytes_equal": int(equal),
        "ipc_receiver_overlaps": int(overlaps),
        "ipc_receiver_checksum_reads_per_push": max(receiver_reads),
        "ipc_checksum_reads_per_push": max(sender_reads),
    }


def receiver(conn, dtype: str, bucket_bytes: int, windows: list, segment: str) -> None:
    """The receiving process: open the windows once, then take each push as it is marked."""
    import torch
    from relayrl.common.weightsync.buckets import Sums, torch_dtype, unpack
    from relayrl.common.weightsync.cudaipc import Shared, open_shared
    from relayrl.common.weightsync.plan import plan_buckets
    from relayrl.common.weightsync.shm import ReadyTable, Segment
    from relayrl.generator.worker_ext import ipc_sources

    torch.cuda.set_device(0)
    plan = metas(dtype)
    buckets = plan_buckets(plan, bucket_bytes)
    params = {m.name: torch.empty(m.shape, dtype=torch_dtype(dtype), device="cuda:0") for m in plan}
    dst = [[params[m.name] for m in b.tensors] for b in buckets]
    bufs = [open_shared(Shared(**w), 0) for w in windows]
    src = [[t for _, t in unpack(b, buf)] for b, buf in zip(buckets, bufs, strict=True)]  # views, once
    table = ReadyTable(Segment.attach(segment), 0, len(buckets))
    reads = Reads()
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        sums = Sums()
        ready = (table, msg, time.monotonic() + WAIT_S)
        for (_, buf, _), into, views in zip(ipc_sources(buckets, bufs, ready), dst, src, strict=True):
            torch._foreach_copy_(into, views)
            sums.add(buf)
        conn.send((sums.read(), reads.take("MainThread")))


def gpu_push(args) -> dict[str, float]:
    """The timed push over CUDA IPC (see the module docstring); its figures."""
    import torch
    from relayrl.common.weightsync.buckets import Staging, checksum, pack, torch_dtype
    from relayrl.common.weightsync.cudaipc import share, window
    from relayrl.common.weightsync.plan import aligned, plan_buckets
    from relayrl.common.weightsync.shm import ReadyTable, Segment
    from relayrl.learner.push import Sinks, send_buckets

    torch.cuda.set_device(0)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    plan = metas(args.dtype)
    buckets = plan_buckets(plan, bucket_bytes)
    dt = torch_dtype(args.dtype)
    params = {m.name: torch.randn(m.shape, device="cuda:0").to(dt) for m in plan}
    staging = Staging(buckets, device="cuda:0")
    whole = share(staging.buf)
    windows = [
        dataclasses.asdict(window(whole, o, b.nbytes)) for b, o in zip(buckets, staging.offsets, strict=True)
    ]
    seg = Segment.create(aligned(len(buckets) * ReadyTable.ENTRY), "bench")
    table = ReadyTable(seg, 0, len(buckets))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, args.dtype, bucket_bytes, windows, seg.name))
    proc.start()
    reads = Reads()
    push, copy, sender_reads, receiver_reads, same = [], [], [], [], True
    try:
        assert here.poll(300) and here.recv() == "ready", "the receiver did not start"
        nbytes = sum(b.nbytes for b in buckets)
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(src)
        for k in range(1, args.repeats + 2):
            torch.cuda.synchronize()
            reads.take("MainThread")  # the sender's reads of this push only
            t0 = time.perf_counter()
            here.send(k)  # the receiver waits for the marks of push k while the sender stages
            items = ([params[m.name] for m in b.tensors] for b in buckets)
            _, sums = send_buckets(
                buckets, items, Sinks(ipc=staging, on_ipc_ready=lambda i, k=k: table.mark(i, k, 0))
            )
            assert here.poll(WAIT_S), "the receiver did not answer"
            got, their_reads = here.recv()
            t1 = time.perf_counter()
            same &= got == sums
            dst.copy_(src)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            sender_reads.append(reads.take("MainThread"))
            receiver_reads.append(their_reads)
            if k > 1:  # the first round warms allocator and kernels
                push.append(t1 - t0)
                copy.append(t2 - t1)
        here.send("stop")
        for b, view, got_sum in zip(buckets, staging.views, sums, strict=True):
            packed = pack(b, [params[m.name] for m in b.tensors], "cuda:0")  # the old packing
            same &= torch.equal(view, packed) and got_sum == checksum(packed)
    finally:
        reads.close()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        seg.close()
    p, c = statistics.median(push), statistics.median(copy)
    gb = nbytes / 1e9
    row = [f"{gb:.3f}", str(len(buckets)), f"{p:.4f}", f"{c:.4f}", f"{gb / p:.1f}", f"{p / c:.2f}"]
    print_table(
        ["model", "dtype", "GB", "buckets", "IPC push s", "device copy s", "push GB/s", "ratio"],
        [["0.5B shape", args.dtype, *row]],
        title=f"CUDA IPC push to a receiver on the same GPU ({torch.cuda.get_device_name(0)}), "
        f"median of {args.repeats}",
    )
    return {  # the headline last
        "ipc_buckets": len(buckets),
        "ipc_gpu_bytes_equal": int(same),
        "ipc_gpu_receiver_checksum_reads_per_push": max(receiver_reads),
        "ipc_gpu_checksum_reads_per_push": max(sender_reads),
        "ipc_push_vs_copy_ratio": round(p / c, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cpu-size", default="10m", help="model shape of the CPU check (bench/learner.py)")
    ap.add_argument("--cpu-bucket-mb", type=float, default=4, help="bucket size of the CPU check")
    args = ap.parse_args()
    import relayrl  # noqa: F401
    import torch

    figures = cpu_check(args.cpu_size, int(args.cpu_bucket_mb * (1 << 20)), args.dtype)
    if torch.cuda.is_available():
        figures.update(gpu_push(args))
    else:
        print(
            "sync_ipc: no CUDA device here; the push itself needs a GPU (ipc_push_vs_copy_ratio not measured)"
        )
    for name, value in figures.items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
