"""What a person sees of a run: a progress bar on a terminal (a line per step in a log), and the
reward curve written into the run folder."""

from __future__ import annotations

import sys
from pathlib import Path

SHOWN_ON_BAR = ("reward_mean", "eval_accuracy", "kl", "kl_reward", "critic_explained_var")
SHOWN_ON_LINE = (
    "reward_mean",
    "eval_accuracy",
    "loss",
    "kl",
    "entropy",
    # PPO: the critic's value loss and how much of the returns' spread it explains, the KL to
    # the reference in the reward and its coefficient (adaptive controller)
    "critic_loss",
    "critic_explained_var",
    "kl_reward",
    "kl_coef",
    "time_generate",
    "time_train",
    "time_sync",
)
"""What a step shows: on a terminal's progress bar, and on the line per step in a log."""


def progress(total: int, start: int):
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

        def show(rec: dict) -> None:
            if "reward_mean" in rec:
                bar.update(1)
            post = {k: f"{rec[k]:.3f}" for k in SHOWN_ON_BAR if k in rec}
            bar.set_postfix(post)

        return show, bar.close

    def log_line(rec: dict) -> None:
        parts = [f"step {rec['step']}/{total}"] + [f"{k} {rec[k]:.3f}" for k in SHOWN_ON_LINE if k in rec]
        print("  ".join(parts), flush=True)

    return log_line, lambda: None


def plot(run_dir: Path, records: list[dict], eval_label: str = "held-out greedy accuracy") -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    if not steps and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="train reward (mean)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_accuracy"] for r in evals],
            "o-",
            label=eval_label,
        )
    tools = [r for r in steps if "tool_calls_per_episode" in r]  # episodes with tools
    if tools:
        ax.plot(
            [r["step"] for r in tools],
            [r["tool_calls_per_episode"] for r in tools],
            "--",
            label="tool calls per episode (train)",
        )
    ax.set_xlabel("step")
    ax.set_ylim(-0.05, max([1.05] + [r["tool_calls_per_episode"] + 0.05 for r in tools]))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    out = run_dir / "reward_curve.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
