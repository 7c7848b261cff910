"""The learner service's TrainStep against plain PyTorch on the same model, batch and micro-batches.

    python bench/learner.py [--sizes tiny,10m] [--steps 4] [--stages 3]       # CPU
    python bench/learner.py --sizes 0.5b,1.5b --steps 4 --stages 3,2          # a CUDA machine
    python bench/learner.py --skewed 10m-skewed                               # packed vs padded

relayrl: a learner service (world size 1, ZeRO stage as given) answering ``TrainStep`` over gRPC,
timed end to end by the caller (decode, micro-batches, chunked log-probs, GRPO loss, backward,
optimizer step). Plain PyTorch: a separate process running the HF model with AdamW (fused on
CUDA), the same micro-batches of the same samples and the same loss on the full-vocabulary
logits, as a user's own training loop would. Both: random-init weights of the named shape,
float32 on CPU and bfloat16 on CUDA, medians of ``--steps`` steps after one warm-up step, in one
run. Peak memory: the CUDA allocator's peak during a step, or on CPU the process's peak RSS. MFU
(CUDA): 6 x parameters x tokens per second over the GPU's dense bf16 peak. The learner's
SaveCheckpoint and LoadCheckpoint are timed too. ``learner_vs_torch_ratio: X`` is the step-time
ratio of the largest model run at the first of ``--stages`` (default: the learner's own stage for
one rank, ``ONE_RANK_STAGE``; target <= 1.25, and peak memory no higher).

Memory on CPU: ``learner_peak_vs_torch_ratio`` compares the service's rank process (it trains and
serves gRPC) with the plain loop's process; ``learner_trainer_peak_vs_torch_ratio`` compares the
same trainer run alone in a process of its own, which tells what training holds from what serving
adds: a constant of a few tens of MiB (the gRPC library's pages, its threads and their heap
arenas), whatever the model's size. On CUDA both are the allocator's peak during a step.
"tensors MiB" (CPU) is the CPU's counterpart of that allocator peak (``tensor_peak_mb``): tensor
bytes only, weights and optimizer state included. ``learner_tensor_peak_vs_torch_ratio`` compares
the trainer as the service runs it (``packing: auto``, packed for Qwen2) with the plain loop;
``learner_padded_tensor_peak_vs_torch_ratio`` the same trainer padded, as the plain loop runs. On
equal-length samples packing saves no padding, and on CPU it holds one more copy of each layer's
attention output (``attention.py`` runs one SDPA per sample and concatenates; a GPU's varlen
kernel writes one output).

Packed against padded micro-batches (``learner.packing``): the ``--skewed`` workload (completion
lengths drawn from a long-tailed mix, as RL completions are: most short, a few near the limit) runs
through the learner with ``packing: on`` and ``off`` at the same token budget, plain PyTorch
(padded, as a user's loop pads) beside them. Last line: ``packed_vs_padded_ratio: X`` (step time,
target <= 0.8 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table

# name -> (Qwen2 config fields, samples, prompt tokens, completion tokens, micro_batch_tokens)
SHAPES = {
    "tiny": (dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=512), 16, 32, 96, 1024),
    "10m": (dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                 intermediate_size=1024, vocab_size=512), 16, 32, 96, 1024),
    "10m-v32k": (dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                      intermediate_size=1024, vocab_size=32768), 16, 32, 96, 1024),
    # The 10m model on a long-tailed mix of completion lengths (``lengths``): packed vs padded.
    "10m-skewed": (dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                        intermediate_size=1024, vocab_size=512), 32, 32, "skewed:16:480", 2048),
    "0.5b-skewed": (dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936), 64, 128, "skewed:20:1024", 16384),
    # Qwen2.5-0.5B and 1.5B shapes (tied embeddings, vocab 151936): GPU sizes
    "0.5b": (dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936), 64, 128, 384, 16384),
    "1.5b": (dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936), 64, 128, 384, 8192),
    # The 0.5B and 1.5B layer structure (layers, heads, parameters per layer) at narrow widths: what
    # a step dispatches and calls back into Python, counted on CPU (``--count``).
    "0.5b-narrow": (dict(hidden_size=112, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=608, vocab_size=4096), 8, 16, 48, 256),
    "1.5b-narrow": (dict(hidden_size=96, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=560, vocab_size=4096), 8, 16, 48, 256),
}  # fmt: skip
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def make_model(name: str, out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = SHAPES[name][0]
    cfg = Qwen2Config(**fields, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def lengths(spec: int | str, n: int, rng) -> list[int]:
    """Completion lengths: all ``spec`` tokens, or ``skewed:LO:HI``, a long-tailed mix (log-uniform
    between LO and HI: as many completions under 2 x LO as between HI / 2 and HI)."""
    if isinstance(spec, int):
        return [spec] * n
    _, lo, hi = spec.split(":")
    lo, hi = int(lo), int(hi)
    return [int(round(lo * (hi / lo) ** rng.random())) for _ in range(n)]


def samples(name: str, seed: int):
    import random

    from relayrl.learner.v1 import learner_pb2 as lp

    fields, n, prompt, completion, _ = SHAPES[name]
    rng = random.Random(seed)
    vocab = fields["vocab_size"]
    return [
        lp.TrainSample(
            prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt)],
            completion_token_ids=[rng.randrange(vocab) for _ in range(c)],
            generator_logprobs=[-rng.uniform(1.0, 6.0) for _ in range(c)],
            advantage=rng.choice((-1.0, 1.0)) * rng.uniform(0.5, 1.5),
        )
        for c in lengths(completion, n, random.Random(seed + 1000))
    ]


def n_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def run_relayrl(
    name: str,
    model: Path,
    dtype: str,
    stage: int,
    steps: int,
    tmp: Path,
    packing: str = "auto",
    extra: tuple[str, ...] = (),
) -> dict:
    import grpc
    from relayrl.learner.v1 import learner_pb2 as lp
    from relayrl.learner.v1 import learner_pb2_grpc as lg

    from tests.procs import service

    micro = SHAPES[name][4]
    args = ["learner", "--model", str(model), "--world-size", "1", "--dtype", dtype, "--lr", "1e-5",
            "--checkpoint-dir", str(tmp), "--set", f"micro_batch_tokens={micro}", "--set", f"zero_stage={stage}",
            "--set", f"packing={packing}", *(a for kv in extra for a in ("--set", kv))]  # fmt: skip
    with service(args, tmp, timeout=900) as (addr, _):
        stub = lg.LearnerServiceStub(
            grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 1 << 30)])
        )
        times, peaks, tokens = [], [], 0
        for step in range(1, steps + 2):
            req = lp.TrainStepRequest(run_id="bench", step=step, samples=samples(name, step))
            t0 = time.perf_counter()
            resp = stub.TrainStep(req, timeout=3600)
            dt = time.perf_counter() - t0
            peaks.append(resp.metrics.extra.get("peak_memory_mb", 0.0))
            if step > 1:  # the first step warms allocators and caches
                times.append(dt)
            tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in req.samples)
        t0 = time.perf_counter()
        stub.SaveCheckpoint(lp.SaveCheckpointRequest(path="ckpt", tag="bench"), timeout=3600)
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        stub.LoadCheckpoint(lp.LoadCheckpointRequest(path="ckpt", tag="bench"), timeout=3600)
        load = time.perf_counter() - t0
    return {
        "step_s": statistics.median(times),
        "tokens": tokens,
        "peak_mb": max(peaks),
        "save_s": save,
        "load_s": load,
    }


def _worker(
    flag: str, what: str, name: str, model: Path, dtype: str, steps: int, packing: str = "auto"
) -> dict:
    """This script's ``flag`` worker in a process of its own (its memory is its own); its result."""
    out = subprocess.run(
        [sys.executable, __file__, flag, name, str(model), dtype, str(steps), packing],
        capture_output=True, text=True, timeout=7200, check=False,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{what} run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_torch(name: str, model: Path, dtype: str, steps: int) -> dict:
    """The baseline, in its own process."""
    return _worker("--torch-worker", "plain PyTorch", name, model, dtype, steps)


def run_trainer(name: str, model: Path, dtype: str, steps: int, packing: str = "auto") -> dict:
    """relayrl's trainer (the one-rank engine the service runs) alone, in its own process: no
    gRPC server, no service threads. Its peak RSS against the plain loop's tells the training's
    own memory from what serving adds (the gRPC library, its threads and their heap arenas)."""
    return _worker("--trainer-worker", "in-process trainer", name, model, dtype, steps, packing)


def tensor_peak_mb(step) -> float:
    """On CPU, what the CUDA allocator's peak measures on a GPU: the most tensor memory live
    during one ``step()``, in MiB. The tensors live before it (weights, optimizer state), found
    by walking the objects the interpreter tracks (one count per storage), plus the highest the
    CPU allocator's total went above that during the step (torch's profiler with
    ``profile_memory``: it counts the allocations made while it runs). A tensor live before the
    step and freed during it still counts in the first part, so this is an upper bound, tight
    when a step frees what it made (both trainers here drop their gradients at its end). Libraries'
    pages, heap arenas and threads are left out: on a GPU they are host memory, not the device's."""
    import gc

    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            try:
                ptr = storage.data_ptr()
            except RuntimeError:
                # a fake or functional tensor (torch.compile's tracing leaves them behind): it
                # has no memory of its own, so there is nothing to count
                continue
            storages[ptr] = storage.nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    above, events = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        e = events.pop()
        events.extend(e.children)
        if e.tag == _EventType.Allocation:
            above = max(above, e.extra_fields.total_allocated)
    return (sum(storages.values()) + above) / 2**20


def trainer_worker(name: str, model_dir: str, dtype: str, steps: int, packing: str) -> None:
    import resource
    import socket

    from relayrl.learner.config import ONE_RANK_STAGE, LearnerConfig
    from relayrl.learner.rank import init_distributed
    from relayrl.learner.samples import decode_samples
    from relayrl.learner.trainer import Trainer
    from relayrl.learner.v1 import learner_pb2 as lp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    init_distributed(with_deepspeed=ONE_RANK_STAGE != 0)
    cfg = LearnerConfig(model=model_dir, dtype=dtype, micro_batch_tokens=SHAPES[name][4], packing=packing)
    t = Trainer(cfg)
    cuda = t.device.type == "cuda"

    def one(step: int) -> dict:
        req = lp.TrainStepRequest(samples=samples(name, step))
        return t.train_step(decode_samples(req, t.vocab_size, t.max_len, cfg), SHAPES[name][3])

    times, peaks = [], []
    for step in range(1, steps + 2):
        t0 = time.perf_counter()
        out = one(step)
        if step > 1:
            times.append(time.perf_counter() - t0)
        peaks.append(
            out["peak_memory_mb"] if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
    res = {"step_s": statistics.median(times), "peak_mb": max(peaks)}
    if not cuda:  # after the timed steps: the profiler slows the step it watches
        res["tensor_peak_mb"] = tensor_peak_mb(lambda: one(steps + 2))
    print(json.dumps(res))


def torch_worker(name: str, model_dir: str, dtype: str, steps: int, packing: str) -> None:
    """Plain PyTorch: HF model, AdamW, same micro-batches and loss, full-vocabulary logits;
    always padded (``packing`` is the workers' common signature), as a user's loop pads."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(dev)
    step_fn = torch_step(name, model, dev)
    times, peaks = [], []
    for step in range(1, steps + 2):
        batch = samples(name, step)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        step_fn(batch)
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**20)
        else:
            peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if step > 1:
            times.append(time.perf_counter() - t0)
    res = {"step_s": statistics.median(times), "peak_mb": max(peaks)}
    if not cuda:
        res["tensor_peak_mb"] = tensor_peak_mb(lambda: step_fn(samples(name, steps + 2)))
    print(json.dumps(res))


def torch_step(name: str, model, dev):
    """Plain PyTorch's step on ``model``: HF forward, full-vocabulary logits, the loss, backward,
    the clip, fused AdamW (as a user's loop on a GPU runs it; fused on CPU too)."""
    import torch
    from relayrl.learner.batching import plan_step
    from relayrl.learner.config import LossConfig
    from relayrl.learner.losses import LossInputs, Totals, policy_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    cfg, micro = LossConfig(), SHAPES[name][4]

    def step(batch) -> None:
        lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in batch]
        totals = Totals(tokens=sum(len(s.completion_token_ids) for s in batch), sequences=len(batch))
        for mb in plan_step(lengths, 1, micro)[0]:
            rows = [batch[i] for i in mb]
            # Right-padded rows (causal attention: no real token sees a pad), full-vocabulary
            # logits at the positions that predict each completion token.
            width = max(len(s.completion_token_ids) for s in rows)
            total = max(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in rows)
            ids = torch.zeros(len(rows), total, dtype=torch.long)
            targets = torch.zeros(len(rows), width, dtype=torch.long)
            beh, mask = torch.zeros(2, len(rows), width)
            for r, s in enumerate(rows):
                p, c = len(s.prompt_token_ids), len(s.completion_token_ids)
                ids[r, : p + c] = torch.tensor(list(s.prompt_token_ids) + list(s.completion_token_ids))
                targets[r, :c], mask[r, :c] = ids[r, p : p + c], 1.0
                beh[r, :c] = torch.tensor(list(s.generator_logprobs))
            ids, targets, beh, mask = ids.to(dev), targets.to(dev), beh.to(dev), mask.to(dev)
            starts = torch.tensor([len(s.prompt_token_ids) for s in rows], device=dev)
            at = (starts[:, None] + torch.arange(width, device=dev)[None] - 1).clamp(max=total - 1)
            logits = model(input_ids=ids).logits
            logits = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])).float()
            logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
            adv = torch.tensor([s.advantage for s in rows], device=dev)
            loss, _ = policy_loss(LossInputs(logp, beh, adv, mask), cfg, totals)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine_name(stage: int) -> str:
    return "plain engine" if stage == 0 else f"ZeRO-{stage}"


def count_step(step, *args) -> tuple[int, int]:
    """(operators, Python calls from autograd) of one ``step(*args)``. Operators: the ``aten::``
    ops the profiler records that no other aten op dispatched (what a GPU would launch kernels
    for, one or more each). Python calls from autograd: every Python function the autograd engine
    enters during backward (tensor and gradient-accumulation hooks, saved-tensor hooks, custom
    Functions' backward): each one holds the autograd thread in the interpreter."""
    from torch.profiler import ProfilerActivity, profile

    calls = [0]

    def tracer(frame, event, arg):
        if (
            event == "call"
            and frame.f_back is not None
            and frame.f_back.f_code.co_name == "_engine_run_backward"
        ):
            calls[0] += 1

    sys.setprofile(tracer)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(*args)
    finally:
        sys.setprofile(None)
    ops = sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
    return ops, calls[0]


def count_main(names: list[str]) -> list[tuple[str, str, int, int]]:
    """Counts of one training step (after a warm-up step) for relayrl's learner, one rank (its
    default engine, and ZeRO-2 for contrast), and the plain loop, in this process on CPU. The
    ratio compares like with like: padded micro-batches, as the plain loop runs them. Packed ones
    are counted too, but on CPU their attention runs one SDPA per sample (``attention.py``), where
    a GPU runs one varlen kernel per layer: more operators here, fewer there."""
    import socket

    import torch
    from relayrl.learner.config import LearnerConfig
    from relayrl.learner.rank import init_distributed
    from relayrl.learner.samples import decode_samples
    from relayrl.learner.trainer import Trainer
    from relayrl.learner.v1 import learner_pb2 as lp
    from transformers import AutoModelForCausalLM

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    init_distributed()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model = make_model(name, Path(tmp) / name)
            plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            step = torch_step(name, plain, torch.device("cpu"))
            step(samples(name, 1))
            out.append((name, "plain PyTorch", *count_step(step, samples(name, 2))))
            for stage, packing, who in (
                (0, "off", "relayrl"),
                (0, "on", "relayrl packed"),
                (2, "off", "relayrl (ZeRO-2)"),
            ):
                cfg = LearnerConfig(
                    model=str(model), zero_stage=stage, micro_batch_tokens=SHAPES[name][4], packing=packing
                )
                t = Trainer(cfg)
                batches = [
                    decode_samples(
                        lp.TrainStepRequest(samples=samples(name, k)), t.vocab_size, t.max_len, cfg
                    )
                    for k in (1, 2)
                ]
                t.train_step(batches[0], SHAPES[name][3])
                out.append((name, who, *count_step(t.train_step, batches[1], SHAPES[name][3])))
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--torch-worker", "--trainer-worker"):
        worker = torch_worker if sys.argv[1] == "--torch-worker" else trainer_worker
        return worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    import torch

    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5b,1.5b" if cuda else "tiny,10m")
    ap.add_argument("--steps", type=int, default=4)
    from relayrl.learner.config import ONE_RANK_STAGE

    ap.add_argument(
        "--stages",
        default=str(ONE_RANK_STAGE),
        help="ZeRO stages to run relayrl with, e.g. 2,3 (the first gives the ratio)",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="extra relayrl rows on each size: NAME:KEY=VALUE[,KEY=VALUE...] separated by ';', e.g. "
        "'ckpt:gradient_checkpointing=true;persist0:param_persistence_threshold=0'",
    )
    ap.add_argument(
        "--skewed",
        default="0.5b-skewed" if cuda else "10m-skewed",
        help="long-tailed workload(s) run packed and padded ('' for none)",
    )
    ap.add_argument(
        "--count",
        default="",
        help="count operators and Python calls from autograd per step (CPU, in process) at these "
        "sizes, e.g. 0.5b-narrow,1.5b-narrow, then stop",
    )
    args = ap.parse_args()
    if args.count:
        counted = count_main(args.count.split(","))
        plain = {n: ops for n, who, ops, _ in counted if who == "plain PyTorch"}
        print_table(
            ["model", "trainer", "operators", "vs torch", "Python calls from autograd"],
            [[n, who, f"{ops:,}", f"{ops / plain[n]:.2f}", f"{calls:,}"] for n, who, ops, calls in counted],
            title="one TrainStep on CPU, counted (torch profiler: aten ops dispatched at top level)",
        )
        ours = [(n, ops, calls) for n, who, ops, calls in counted if who == "relayrl"]
        print(f"learner_python_calls_from_autograd: {max(c for _, _, c in ours)}")
        print(f"learner_ops_vs_torch_ratio: {max(ops / plain[n] for n, ops, _ in ours):.3f}")
        return
    dtype = "bfloat16" if cuda else "float32"
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None) if cuda else None
    rows, ratio, packed_ratio, mem, tensors = [], None, None, None, None
    stages = [int(s) for s in args.stages.split(",")]

    def row(name: str, params: int, who: str, res: dict, base: dict, tokens: int) -> None:
        tps = tokens / res["step_s"]
        mfu = f"{6 * params * tps / (peak * 1e12):.0%}" if peak else "-"
        rows.append([name, f"{params / 1e6:.1f}M", who, f"{res['step_s']:.3f}", f"{tps:,.0f}",
                     f"{res['peak_mb']:,.0f}", f"{res['tensor_peak_mb']:,.1f}" if "tensor_peak_mb" in res else "-",
                     mfu, f"{res['step_s'] / base['step_s']:.2f}",
                     f"{res['save_s']:.2f}" if "save_s" in res else "-",
                     f"{res['load_s']:.2f}" if "load_s" in res else "-"])  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in args.sizes.split(",") if n]:
            model = make_model(name, Path(tmp) / name)
            params = n_params(model)
            base = run_torch(name, model, dtype, args.steps)
            for stage in stages:
                r = run_relayrl(name, model, dtype, stage, args.steps, Path(tmp) / f"{name}-z{stage}")
                if stage == stages[0]:
                    ratio = r["step_s"] / base["step_s"]
                row(name, params, f"relayrl ({engine_name(stage)})", r, base, r["tokens"])
                if stage == stages[0]:
                    alone = run_trainer(name, model, dtype, args.steps)
                    row(name, params, "relayrl trainer alone (no gRPC)", alone, base, r["tokens"])
                    mem = (r["peak_mb"] / base["peak_mb"], alone["peak_mb"] / base["peak_mb"])
                    if not cuda:  # like with like: padded, as the plain loop runs
                        padded = run_trainer(name, model, dtype, args.steps, "off")
                        row(name, params, "relayrl trainer alone, padded", padded, base, r["tokens"])
                        tensors = (alone["tensor_peak_mb"] / base["tensor_peak_mb"],
                                   padded["tensor_peak_mb"] / base["tensor_peak_mb"])  # fmt: skip
            for variant in [v for v in args.variants.split(";") if v]:
                label, _, sets = variant.partition(":")
                v = run_relayrl(name, model, dtype, stages[0], args.steps, Path(tmp) / f"{name}-{label}",
                                extra=tuple(sets.split(",")))  # fmt: skip
                row(name, params, f"relayrl ({engine_name(stages[0])}) {label}", v, base, v["tokens"])
            row(name, params, "plain PyTorch", base, base, r["tokens"])
        for name in [n for n in args.skewed.split(",") if n]:
            model = make_model(name, Path(tmp) / name)
            params = n_params(model)
            base = run_torch(name, model, dtype, args.steps)
            got = {
                mode: run_relayrl(
                    name, model, dtype, stages[0], args.steps, Path(tmp) / f"{name}-{mode}", mode
                )
                for mode in ("on", "off")
            }
            for mode, who in (("on", "packed"), ("off", "padded")):
                row(
                    name,
                    params,
                    f"relayrl {who} ({engine_name(stages[0])})",
                    got[mode],
                    base,
                    got[mode]["tokens"],
                )
            row(name, params, "plain PyTorch (padded)", base, base, got["on"]["tokens"])
            packed_ratio = got["on"]["step_s"] / got["off"]["step_s"]
    print_table(
        [
            "model",
            "params",
            "trainer",
            "step s",
            "tokens/s",
            "peak MiB",
            "tensors MiB",
            "MFU",
            "vs torch",
            "save s",
            "load s",
        ],
        rows,
        title=f"TrainStep, {dtype}, world size 1, medians of {args.steps} steps, on {device}",
    )
    if ratio is not None:
        print(f"learner_vs_torch_ratio: {ratio:.3f}")
    if mem is not None:
        print(f"learner_peak_vs_torch_ratio: {mem[0]:.3f}")
        print(f"learner_trainer_peak_vs_torch_ratio: {mem[1]:.3f}")
    if tensors is not None:
        print(f"learner_tensor_peak_vs_torch_ratio: {tensors[0]:.3f}")
        print(f"learner_padded_tensor_peak_vs_torch_ratio: {tensors[1]:.3f}")
    if packed_ratio is not None:
        print(f"packed_vs_padded_ratio: {packed_ratio:.3f}")


if __name__ == "__main__":
    main()
