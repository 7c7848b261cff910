"""CUDA IPC weight push to a receiver on the same GPU, the 0.5B shape (needs CUDA; no vLLM there).

    python bench/sync_ipc.py [--repeats 10] [--bucket-mb 256] [--dtype bfloat16]

The learner side is relayrl's own push code: the parameters of a Qwen2.5-0.5B-shaped model (on
the GPU, in ``--dtype``) are planned into buckets, packed by ``send_buckets`` into staging
buffers shared once with ``cudaipc.share`` (as the learner's weight sync shares them at
registration), and their checksums taken. The receiver, another process on the same GPU, opens
the buffers from the plain fields, copies every tensor out into its own parameters (what a
generator's load does, minus vLLM's weight loaders) and checksums each bucket; the push ends
when it answers. Baseline: a device-to-device copy of the same bytes in one process. Prints the
medians and ``ipc_push_vs_copy_ratio``. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table


def metas(dtype: str) -> list:
    """Names and shapes of the 0.5B model's parameters (``bench/learner.py``'s Qwen2.5-0.5B shape,
    tied embeddings), from a model on the meta device: nothing is allocated."""
    import torch
    from relayrl.common.weightsync.plan import TensorMeta
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.learner import SHAPES

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES["0.5b"][0], tie_word_embeddings=True))
    return [TensorMeta(n, dtype, tuple(p.shape)) for n, p in model.named_parameters()]


def receiver(conn, dtype: str, bucket_bytes: int) -> None:
    import torch
    from relayrl.common.weightsync.buckets import checksum, torch_dtype, unpack
    from relayrl.common.weightsync.cudaipc import Shared, open_shared
    from relayrl.common.weightsync.plan import plan_buckets

    torch.cuda.set_device(0)
    plan = metas(dtype)
    buckets = plan_buckets(plan, bucket_bytes)
    params = {m.name: torch.empty(m.shape, dtype=torch_dtype(dtype), device="cuda:0") for m in plan}
    bufs = [open_shared(Shared(**f), 0) for f in conn.recv()]
    conn.send("ready")
    while conn.recv() == "push":
        sums = []
        for b, buf in zip(buckets, bufs, strict=True):
            for name, t in unpack(b, buf):
                params[name].copy_(t)
            sums.append(checksum(buf))
        torch.cuda.synchronize()
        conn.send(sums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    import relayrl  # noqa: F401
    import torch

    if not torch.cuda.is_available():
        print("sync_ipc: no CUDA device here; CUDA IPC needs a GPU (skipped)")
        return
    from relayrl.common.weightsync.buckets import torch_dtype
    from relayrl.common.weightsync.cudaipc import share
    from relayrl.common.weightsync.plan import plan_buckets
    from relayrl.learner.push import Sinks, send_buckets

    torch.cuda.set_device(0)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    plan = metas(args.dtype)
    buckets = plan_buckets(plan, bucket_bytes)
    dt = torch_dtype(args.dtype)
    params = {m.name: torch.randn(m.shape, device="cuda:0").to(dt) for m in plan}
    staging = [torch.empty(b.nbytes, dtype=torch.uint8, device="cuda:0") for b in buckets]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, args.dtype, bucket_bytes))
    proc.start()
    try:
        here.send([dataclasses.asdict(share(t)) for t in staging])
        assert here.recv() == "ready"
        nbytes = sum(b.nbytes for b in buckets)
        push, copy = [], []
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(src)
        for i in range(args.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            items = ([params[m.name] for m in b.tensors] for b in buckets)
            _, sums = send_buckets(buckets, items, Sinks(ipc=staging))
            torch.cuda.synchronize()  # packed and checksummed before the handover
            here.send("push")
            got = here.recv()
            t1 = time.perf_counter()
            assert got == sums, "the receiver read other bytes than were packed"
            dst.copy_(src)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i:  # the first round warms allocator and kernels
                push.append(t1 - t0)
                copy.append(t2 - t1)
        here.send("stop")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    p, c = statistics.median(push), statistics.median(copy)
    gb = nbytes / 1e9
    print_table(
        ["model", "dtype", "GB", "buckets", "IPC push s", "device copy s", "push GB/s", "ratio"],
        [
            [
                "0.5B shape",
                args.dtype,
                f"{gb:.3f}",
                str(len(buckets)),
                f"{p:.4f}",
                f"{c:.4f}",
                f"{gb / p:.1f}",
                f"{p / c:.2f}",
            ]
        ],  # fmt: skip
        title=f"CUDA IPC push to a receiver on the same GPU ({torch.cuda.get_device_name(0)}), "
        f"median of {args.repeats}",
    )
    print(f"ipc_push_vs_copy_ratio: {p / c:.3f}")


if __name__ == "__main__":
    main()
