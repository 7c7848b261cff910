"""Weight sync: PushWeights against the raw transport of the same bytes, per transport, one run.

    python bench/sync.py [--sizes 10m,100m] [--transports shm,gloo] [--repeats 3] [--rounds 2] [--bucket-mb 64]

For each model size and transport a learner (1 rank, ZeRO-3, ``weight_sync_transport`` forced)
and a generator (vLLM) run as services, as in production. ``PushWeights`` is timed end to end:
gather the ZeRO-3 shards, pack buckets, send them (gloo: broadcast over the weight-sync group;
shm: write them into the shared-memory segment and mark each in its ready table; the replica
loads each bucket as it is marked while the learner gathers the next), load into vLLM, answer. The
baseline is ``PushWeights(transport_only)`` between the same two processes over the same
transport: the same buckets of bytes sent and read (a broadcast, or a plain copy into and out of
shared memory), nothing gathered, packed or loaded. With ``--lora R`` the larger model also runs
with a LoRA learner (``learner.lora``, rank R, every projection) pushing its adapter alone over
the first transport, loaded through vLLM's LoRA API (``engine.max_lora_rank``). Last lines:
``sync_vs_raw_broadcast_ratio`` (gloo, the larger model; target <= 1.25),
``shm_vs_gloo_push_ratio`` (the larger model's PushWeights over shm against over gloo; target
<= 0.5) and, with ``--lora``, ``lora_vs_full_push_ratio`` (the adapter's PushWeights against the
full model's, same transport; target <= 0.1).

CPU seconds (user + system) of both services' process trees are read around every call. On a
machine with C cores a push cannot take less than its CPU seconds / C of wall time however well
gather, broadcast and load overlap; ``cpu floor`` is that bound divided by the raw broadcast,
the best ratio this machine allows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table

SIZES = {  # name -> TinySpec kwargs (head_dim 64 for vLLM's CPU attention)
    "10m": dict(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1024),
    "100m": dict(hidden_size=1024, num_layers=9, num_heads=16, num_kv_heads=4, intermediate_size=2816),
}


def measure(
    name: str, model: str, repeats: int, bucket_mb: float, tmp: Path, transport: str, lora: int = 0
) -> dict:
    import grpc
    from relayrl.learner.v1 import learner_pb2 as lp
    from relayrl.learner.v1 import learner_pb2_grpc as lg

    from tests.procs import service

    gen = [
        "generator",
        "--model",
        model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--replica-id",
        "g0",
    ]
    lrn = ["learner", "--model", model, "--world-size", "1", "--set", f"bucket_mb={bucket_mb}",
           "--set", f"weight_sync_transport={transport}"]  # fmt: skip
    if lora:
        gen += ["--set", f"engine.max_lora_rank={lora}"]
        lrn += ["--set", f"lora.rank={lora}"]
    with service(gen, tmp, timeout=600) as (gaddr, gproc), service(lrn, tmp, timeout=600) as (laddr, lproc):

        def cpu() -> float:  # CPU seconds so far of both services, all their processes
            return sum(sum(p.cpu_times()[:2]) for sp in (gproc, lproc) for p in sp._tree())

        stub = lg.LearnerServiceStub(grpc.insecure_channel(laddr))
        reg = stub.RegisterGenerator(lp.RegisterGeneratorRequest(address=gaddr, replica_id="g0"), timeout=120)
        assert reg.transport == transport, reg
        sample = lp.TrainSample(
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[4, 5],
            generator_logprobs=[-1, -1],
            advantage=1.0,
        )
        raw = stub.PushWeights(
            lp.PushWeightsRequest(transport_only=True), timeout=600
        )  # forms the group, warms up
        push, base, push_cpu, base_cpu = [], [], [], []
        for step in range(1, repeats + 2):
            stub.TrainStep(lp.TrainStepRequest(step=step, samples=[sample]), timeout=600)
            c0 = cpu()
            r = stub.PushWeights(lp.PushWeightsRequest(version=step), timeout=600)
            c1 = cpu()
            raw = stub.PushWeights(lp.PushWeightsRequest(transport_only=True), timeout=600)
            c2 = cpu()
            if step > 1:  # the first push warms the load path
                push.append(r.seconds)
                base.append(raw.seconds)
                push_cpu.append(c1 - c0)
                base_cpu.append(c2 - c1)
    return {"bytes": r.bytes, "push": push, "raw": base, "push_cpu": push_cpu, "raw_cpu": base_cpu}


def summarise(name: str, transport: str, runs: list[dict]) -> dict:
    """Medians over every round's samples of one model and transport."""

    def med(key: str) -> float:
        return statistics.median(x for r in runs for x in r[key])

    p, b = med("push"), med("raw")
    return {
        "transport": transport,
        "name": name,
        "bytes": runs[0]["bytes"],
        "push": p,
        "raw": b,
        "ratio": p / b,
        "push_cpu": med("push_cpu"),
        "raw_cpu": med("raw_cpu"),
        "floor": med("push_cpu") / (os.cpu_count() or 1) / b,
        "samples": sum(len(r["push"]) for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10m,100m")
    ap.add_argument("--transports", default="shm,gloo", help="those this machine can run: shm, gloo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--lora", type=int, default=16, help="LoRA rank of the adapter row (0: none)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measure the transports this many times each, in alternating order (shared machines drift)",
    )
    args = ap.parse_args()
    import relayrl  # noqa: F401
    from relayrl.common.modelkit.tiny import TinySpec, write_tiny_model

    rows = []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            model = write_tiny_model(Path(tmp) / name, seed=0, spec=TinySpec(**SIZES[name]))
            transports = args.transports.split(",")
            lora = f"{transports[0]}+lora" if args.lora and name == args.sizes.split(",")[-1] else ""
            kinds = transports + ([lora] if lora else [])
            runs: dict[str, list[dict]] = {t: [] for t in kinds}
            for k in range(args.rounds):
                for kind in kinds if k % 2 == 0 else kinds[::-1]:
                    transport, _, adapter = kind.partition("+")
                    runs[kind].append(
                        measure(
                            name,
                            str(model),
                            args.repeats,
                            args.bucket_mb,
                            Path(tmp),
                            transport,
                            args.lora if adapter else 0,
                        )  # fmt: skip
                    )
            for transport in kinds:
                res = summarise(name, transport, runs[transport])
                results.append(res)
                gb = res["bytes"] / 1e9
                rows.append(
                    [
                        name,
                        transport,
                        f"{res['bytes'] / 4e6:.1f}M",
                        f"{gb:.3f}",
                        f"{res['push']:.3f}",
                        f"{res['raw']:.3f}",
                        f"{gb / res['push']:.2f}",
                        f"{res['ratio']:.2f}",
                        f"{res['push_cpu']:.2f}",
                        f"{res['raw_cpu']:.2f}",
                        f"{res['floor']:.2f}",
                    ]
                )
    print_table(
        [
            "model",
            "transport",
            "params",
            "GB (fp32)",
            "PushWeights s",
            "raw transport s",
            "push GB/s",
            "ratio",
            "push CPU s",
            "raw CPU s",
            "cpu floor",
        ],
        rows,
        title=f"weight sync, learner (1 rank) -> 1 generator on this host, buckets {args.bucket_mb} MiB, "
        f"median of {args.rounds} rounds x {args.repeats} pushes in alternating order, {os.cpu_count()} cores",
    )
    last = {r["transport"]: r for r in results if r["name"] == results[-1]["name"]}
    if "gloo" in last:
        print(f"sync_vs_raw_broadcast_ratio: {last['gloo']['ratio']:.3f}")
    if "gloo" in last and "shm" in last:
        print(f"shm_vs_gloo_push_ratio: {last['shm']['push'] / last['gloo']['push']:.3f}")
    adapters = [r for r in results if r["transport"].endswith("+lora")]
    if adapters:
        a = adapters[0]
        full = last[a["transport"].split("+")[0]]
        print(f"lora_vs_full_push_bytes_ratio: {a['bytes'] / full['bytes']:.4f}")
        print(f"lora_vs_full_push_ratio: {a['push'] / full['push']:.3f}")


if __name__ == "__main__":
    main()
