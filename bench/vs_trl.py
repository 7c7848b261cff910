"""relayrl against TRL's GRPOTrainer: the same GRPO run on the same machine, in one invocation.

    python bench/vs_trl.py [--model-size tiny|10m|30m] [--steps N] [--lr 2e-4] [--smoke] [...]

Workload (R1-style: generation carries real weight): digit reversal with the step-by-step
``<think>`` trace, 11-14 digits, so a correct completion is 103-127 tokens; ``--max-tokens``
128. One tiny Qwen2 (``--model-size``) is warm-started with supervised steps on the trace and
cached in ``models/vs-trl-<size>``. Both systems start from it and train on the same prompts in
the same order, with the same G (``--n``), prompts per step, learning rate, completion length,
steps and reward (relayrl's ``score_reverse``): GRPO with group std scaling, no KL,
temperature 1, clip 0.2, AdamW at a constant learning rate, gradient norm clipped at 1.

Runs: TRL 1.16 GRPOTrainer (CPU, HF generation, all cores as torch threads, in ``.venv-trl``,
made here when missing), then ``relayrl run`` on the embedded default (vLLM, DeepSpeed ZeRO-3
with ``--learner-ranks`` ranks, reward service; one thread per process) with ``max_staleness``
1 and 0. The tiny model runs all three for 40 steps; ``--model-size 10m|30m`` runs TRL and
staleness 1 for fewer steps, to show how the ratio moves with model size. Held-out greedy exact
match on the test split at step 0, every ``--eval-every`` steps and at the end. Wall time counts
from the first training step and leaves out every evaluation (and start-up).

Reported: samples/s (completions per second of training wall time: prompts x G per step),
generation tokens/s (while generating), wall time and samples to reach ``--threshold`` held-out
accuracy (default: step-0 accuracy + 0.10), final accuracy; seconds per phase and what overlap
(staleness 1 against 0) gained. Results: ``bench/results/vs_trl.json`` (an entry per model size)
rendered to ``vs_trl.md``, plots ``vs_trl.png`` (tiny) and ``vs_trl-<size>.png``. Last line:
``samples_per_s_ratio_vs_trl: X`` (relayrl at staleness 1 over TRL; target >= 3 at equal or
better final accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import print_table  # noqa: E402
from bench.vs_trl_report import (  # noqa: E402
    LABELS,
    SYSTEMS,
    TRL_VERSION,
    machine,
    main_table,
    mean_or_nan,
    overlap_line,
    phase_table,
    plot,
    render_md,
    summarize,
)

TRL_VENV = ROOT / ".venv-trl"
TASK = {"trace": True, "min_len": 11, "max_len": 14}
"""Reverse 11-14 digits with the <think> trace: 103-127 completion tokens."""

# Model sizes: TinySpec fields, the warm start, and the run's defaults (larger models: fewer steps,
# TRL and relayrl at staleness 1 only; they measure how throughput scales).
SIZES: dict[str, dict] = {
    "tiny": {
        "spec": {},
        "sft": (240, 1e-3, 600),
        "steps": 40,
        "eval_every": 5,
        "runs": "trl,relayrl-s1,relayrl-s0",
    },
    "10m": {
        "spec": {
            "hidden_size": 384,
            "num_layers": 6,
            "num_heads": 6,
            "num_kv_heads": 2,
            "intermediate_size": 1024,
        },
        "sft": (120, 1e-3, 480),
        "steps": 16,
        "eval_every": 8,
        "runs": "trl,relayrl-s1",
    },
    "30m": {
        "spec": {
            "hidden_size": 512,
            "num_layers": 8,
            "num_heads": 8,
            "num_kv_heads": 4,
            "intermediate_size": 2048,
        },
        "sft": (80, 5e-4, 320),
        "steps": 8,
        "eval_every": 4,
        "runs": "trl,relayrl-s1",
    },
}
SFT_MORE, SFT_TARGET = 40, 0.15
"""Warm start (``sft``: first steps, learning rate, most steps): the first steps, then SFT_MORE at a
time until the held-out exact match of the whole trace reaches SFT_TARGET (greedy accuracy of
the answer is then ~0.5 on the tiny model: groups carry signal)."""


# ---- environment, model, data ------------------------------------------------------------------


def ensure_trl_env() -> Path:
    """``.venv-trl`` with trl and this machine's torch/transformers/accelerate versions, plus
    relayrl without extras (data loader, scorers); made with venv + pip when missing."""
    py = TRL_VENV / "bin" / "python"
    check = [str(py), "-c", f"import trl, relayrl.reward.scorers; assert trl.__version__ == '{TRL_VERSION}'"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    print(f"making {TRL_VENV} (trl=={TRL_VERSION}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
    pins = [f"{d}=={metadata.version(d)}" for d in ("torch", "transformers", "accelerate")]
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", *pins, f"trl=={TRL_VERSION}", "-e", str(ROOT)], check=True
    )
    subprocess.run(check, check=True)
    return py


def ensure_model(size: str, first_steps: int) -> tuple[Path, dict]:
    """The warm-started model of ``size``, built once into ``models/vs-trl-<size>[-sftN]``."""
    import torch
    from relayrl.common.modelkit.sft import warm_start
    from relayrl.common.modelkit.tiny import TinySpec, update_card, write_tiny_model

    spec, (default_first, lr, most) = SIZES[size]["spec"], SIZES[size]["sft"]
    smoke = first_steps != default_first  # a fixed warm start of its own: no target
    recipe = {"spec": spec, "sft_lr": lr, "first": first_steps, "target": None if smoke else SFT_TARGET}
    recipe |= {"task": TASK, "seed": 0}
    path = ROOT / "models" / f"vs-trl-{size}{f'-sft{first_steps}' if smoke else ''}"
    card_path = path / "relayrl_model.json"
    if card_path.exists() and json.loads(card_path.read_text()).get("vs_trl_recipe") == recipe:
        return path, json.loads(card_path.read_text())
    shutil.rmtree(path, ignore_errors=True)
    print(f"building {path.name}: supervised warm start on the reverse trace ...", flush=True)
    t0 = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # nothing else runs yet: use every core
    write_tiny_model(path, seed=0, spec=TinySpec(**spec))
    done, chunk = 0, first_steps
    while True:
        # Each chunk draws fresh rows (seed) and its own held-out prompts for the check.
        res = warm_start(path, "reverse", chunk, seed=done, lr=lr, task_params=TASK)
        done += chunk
        print(
            f"  {done} steps: held-out exact {res.heldout_exact:.2f} ({time.monotonic() - t0:.0f}s)",
            flush=True,
        )
        if smoke or res.heldout_exact >= SFT_TARGET or done >= most:
            break
        chunk = SFT_MORE
    torch.set_num_threads(threads)
    update_card(path, vs_trl_recipe=recipe, sft_steps=done, sft_heldout_exact=res.heldout_exact)
    return path, json.loads(card_path.read_text())


def write_data(folder: Path, n_test: int) -> tuple[Path, Path]:
    from relayrl.common.data.dataset import write_rows
    from relayrl.common.data.tasks import generate

    folder.mkdir(parents=True, exist_ok=True)
    train, test = folder / "train.parquet", folder / "test.parquet"
    write_rows(generate("reverse", 4000, seed=0, split="train", **TASK), train)
    write_rows(generate("reverse", n_test, seed=0, split="test", **TASK), test)
    return train, test


# ---- the runs ------------------------------------------------------------------------------------


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> None:
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        ).returncode
    if rc:
        sys.exit(f"failed ({rc}); last lines of {log}:\n{log.read_text()[-4000:]}")


def run_trl(py: Path, a, model: Path, train: Path, test: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    threads = a.trl_threads
    cmd = [str(py), str(ROOT / "bench" / "trl_grpo.py"), "--model", str(model), "--train", str(train)]
    cmd += ["--test", str(test), "--out", str(out / "trl.jsonl"), "--steps", str(a.steps)]
    cmd += ["--prompts-per-step", str(a.prompts_per_step), "--n", str(a.n), "--lr", str(a.lr)]
    cmd += ["--max-tokens", str(a.max_tokens), "--eval-every", str(a.eval_every), "--threads", str(threads)]
    run_logged(cmd, out / "trl.log", env={"OMP_NUM_THREADS": str(threads)})
    recs = [json.loads(line) for line in (out / "trl.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    gen_s = sum(r["gen_seconds"] for r in steps)
    score_s = sum(r["score_seconds"] for r in steps)
    wall = steps[-1]["wall"]
    return {
        "steps": len(steps),
        "samples": steps[-1]["samples"],
        "wall": wall,
        "gen_tokens": sum(r["gen_tokens"] for r in steps),
        "phases": {"generate": gen_s, "score": score_s, "train": wall - gen_s - score_s},
        "eval_seconds": sum(r["seconds"] for r in recs if r["kind"] == "eval"),
        "evals": [(r["step"], r["wall"], r["samples"], r["accuracy"]) for r in recs if r["kind"] == "eval"],
        "completion_len_mean": mean_or_nan(
            [r["completions/mean_length"] for r in recs if "completions/mean_length" in r]
        ),
        "threads": threads,
    }


EXPERIMENT = """\
name: vs-trl
seed: 0
runs_dir: {runs}
model: {{path: {model}}}
data: {{train: {train}, test: {test}}}
sampling: {{n: {n}, temperature: 1.0, max_tokens: {max_tokens}}}
algorithm: {{advantage: grpo, scale_std: true}}
schedule: {{steps: {steps}, prompts_per_step: {prompts}, max_staleness: {staleness}, eval_every: {eval_every}, checkpoint_every: 0}}
services: {{generator_replicas: 1, reward_replicas: 1, deadline_seconds: 900}}
learner:
  world_size: {ranks}
  micro_batch_tokens: {micro_tokens}
  optim: {{lr: {lr}, warmup_steps: 0, schedule: constant, weight_decay: 0.0, grad_clip: 1.0}}
  loss: {{kind: grpo, clip_low: 0.2, clip_high: 0.2, kl_coef: 0.0}}
generator:
  engine: {{dtype: float32, max_model_len: 512, kv_cache_gib: {kv_gib}}}
reward: {{workers: 1}}
"""


def run_relayrl(a, staleness: int, model: Path, train: Path, test: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    exp = out / "experiment.yaml"
    exp.write_text(
        EXPERIMENT.format(
            runs=out / "runs",
            model=model,
            train=train,
            test=test,
            n=a.n,
            max_tokens=a.max_tokens,
            steps=a.steps,
            prompts=a.prompts_per_step,
            staleness=staleness,
            eval_every=a.eval_every,
            ranks=a.learner_ranks,
            micro_tokens=a.micro_batch_tokens,
            lr=a.lr,
            kv_gib=a.kv_cache_gib,
        )
    )
    run_logged([sys.executable, "-m", "relayrl.cli", "run", str(exp)], out / "relayrl.log")
    run_dir = next((out / "runs").glob("vs-trl-*"))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Wall time of training: from the end of the step-0 evaluation, less every later evaluation
    # (each runs alone, after the batch in flight finished: see relayrl.coordinator.loop).
    t0, evaluated, samples = recs[0]["time"], 0.0, 0
    evals, steps = [(0, 0.0, 0, recs[0]["eval_accuracy"])], []
    for r in recs[1:]:
        samples += r["groups"] * a.n
        evaluated += r.get("time_eval", 0.0)
        wall = r["time"] - t0 - evaluated
        steps.append(r)
        if "eval_accuracy" in r:
            evals.append((r["step"], wall, samples, r["eval_accuracy"]))
    phases = {k: sum(r[f"time_{k}"] for r in steps) for k in ("generate", "score", "train", "sync", "idle")}
    return {
        "steps": len(steps),
        "samples": samples,
        "wall": wall,
        "gen_tokens": sum(r["gen_tokens"] for r in steps),
        "phases": phases,
        "eval_seconds": sum(r.get("time_eval", 0.0) for r in recs),
        "evals": evals,
        "completion_len_mean": mean_or_nan([r["completion_len_mean"] for r in steps]),
        "dropped_stale_groups": sum(r["dropped_stale_groups"] for r in steps),
        "zero_signal_groups": sum(r["zero_signal_groups"] for r in steps),
        "run_dir": str(run_dir),
    }


# ---- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=list(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, help="learner steps (default: 40 tiny, 16 10m, 10 30m)")
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--eval-every", type=int, help="steps between evaluations (default: per model size)")
    ap.add_argument("--n-test", type=int, default=128, help="held-out prompts")
    ap.add_argument("--threshold", type=float, help="held-out accuracy to reach (default: step 0 + 0.10)")
    ap.add_argument(
        "--sft-steps",
        type=int,
        help="warm-start steps (default: per size, then more until a target accuracy)",
    )
    ap.add_argument("--learner-ranks", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="relayrl learner, per rank")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--trl-threads", type=int, help="torch threads of the TRL process (default: all CPUs)")
    ap.add_argument(
        "--runs", help="comma-separated: trl, relayrl-s1, relayrl-s0 (default: all three for tiny)"
    )
    ap.add_argument(
        "--results", help="folder for vs_trl.{json,md,png} (default bench/results; --smoke: run folder)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="3 steps of 4 prompts x 4, 16 test prompts, 30 SFT steps"
    )
    a = ap.parse_args()
    size = SIZES[a.model_size]
    if a.smoke:
        a.steps, a.prompts_per_step, a.n, a.eval_every, a.n_test = 3, 4, 4, 2, 16
        a.sft_steps = a.sft_steps or 30
        a.runs = a.runs or "trl,relayrl-s1,relayrl-s0"
    a.steps = a.steps or size["steps"]
    a.eval_every = a.eval_every or size["eval_every"]
    a.runs = a.runs or size["runs"]
    a.sft_steps = a.sft_steps or size["sft"][0]
    a.trl_threads = a.trl_threads or os.cpu_count() or 1
    return a


def main() -> None:
    a = parse_args()
    command = "python " + " ".join(
        [Path(sys.argv[0]).as_posix().removeprefix(str(ROOT) + "/"), *sys.argv[1:]]
    )
    wanted = [k.strip() for k in a.runs.split(",") if k.strip()]
    if unknown := set(wanted) - set(SYSTEMS):
        sys.exit(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    t_start = time.monotonic()
    bench_dir = ROOT / "runs" / f"vs-trl-{a.model_size}-{time.strftime('%Y%m%d-%H%M%S')}"
    results = Path(a.results) if a.results else (bench_dir if a.smoke else ROOT / "bench" / "results")
    bench_dir.mkdir(parents=True)
    trl_py = ensure_trl_env() if "trl" in wanted else None
    import relayrl  # noqa: F401  (hides CUDA-built torch add-ons next to a CPU torch)

    model, card = ensure_model(a.model_size, a.sft_steps)
    train, test = write_data(bench_dir / "data", a.n_test)
    runs: dict[str, dict] = {}
    for key in SYSTEMS:
        if key not in wanted:
            continue
        t0 = time.monotonic()
        if key == "trl":
            runs[key] = run_trl(trl_py, a, model, train, test, bench_dir / key)
        else:
            runs[key] = run_relayrl(a, int(key[-1]), model, train, test, bench_dir / key)
        print(f"{LABELS[key]}: done in {time.monotonic() - t0:.0f}s", flush=True)

    step0 = [r["evals"][0][3] for r in runs.values()]
    threshold = a.threshold if a.threshold is not None else round(max(step0) + 0.10, 2)
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "machine": machine(),
        "model": {"size": a.model_size, "parameters": card["parameters"], "sft_steps": card["sft_steps"]},
        "config": {
            k: getattr(a, k)
            for k in (
                "steps",
                "prompts_per_step",
                "n",
                "lr",
                "max_tokens",
                "eval_every",
                "n_test",
                "learner_ranks",
                "micro_batch_tokens",
                "trl_threads",
            )
        },
        "threshold": threshold,
        "runs": runs,
        "summary": {k: summarize(r, threshold) for k, r in runs.items()},
        "total_seconds": time.monotonic() - t_start,
    }
    main_key = "relayrl-s1" if "relayrl-s1" in runs else "relayrl-s0"
    res["ratio"] = (
        res["summary"][main_key]["samples_per_s"] / res["summary"]["trl"]["samples_per_s"]
        if "trl" in runs and main_key in runs
        else float("nan")
    )

    results.mkdir(parents=True, exist_ok=True)
    store = results / "vs_trl.json"
    all_res = json.loads(store.read_text()) if store.exists() else {}
    all_res[a.model_size] = res
    store.write_text(json.dumps(all_res, indent=1) + "\n")
    plot(res, results / ("vs_trl.png" if a.model_size == "tiny" else f"vs_trl-{a.model_size}.png"))
    (results / "vs_trl.md").write_text(render_md(all_res))

    print()
    print_table(
        *main_table(res),
        title=f"relayrl vs TRL, {a.model_size} model ({card['parameters'] / 1e6:.1f}M), "
        f"{a.steps} steps x {a.prompts_per_step} prompts x G={a.n}, max {a.max_tokens} tokens",
    )
    print()
    print_table(*phase_table(res), title="seconds per phase (sums over the run)")
    if ol := overlap_line(res):
        print(ol)
    print(f"results: {results / 'vs_trl.md'} (whole invocation {res['total_seconds'] / 60:.1f} min)")
    print(f"samples_per_s_ratio_vs_trl: {res['ratio']:.2f}")


if __name__ == "__main__":
    main()
