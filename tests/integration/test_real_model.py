"""A real pretrained model learns through the whole system on the CPU: the README's "Try it on a
real model", run as a user runs it.

SmolLM2-135M-Instruct is imported from its PyPI wheel with ``relayrl model import`` and trained by
``relayrl run examples/smollm2-arithmetic.yaml`` (GRPO, every service a local process). Held-out
accuracy of sampled completions must rise by at least 0.2 (the example file says why this task,
prompt and metric). About 15 minutes on 2 cores, so it is a ``long`` test: ``pytest -m long``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long, pytest.mark.timeout(3600)]  # ~15 min alone on 2 cores
REPO = Path(__file__).resolve().parents[2]


def _relayrl(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_smollm2_learns_arithmetic_on_the_cpu(smollm2_wheel, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    model = tmp_path / "smollm2-135m-instruct"
    imp = _relayrl("model", "import", str(smollm2_wheel), "--out", str(model), cwd=tmp_path, timeout=600)
    assert imp.returncode == 0, imp.stderr[-2000:]

    sets = {
        "model.path": model,
        "runs_dir": tmp_path / "runs",
        "data.train": tmp_path / "data" / "train.jsonl",
        "data.test": tmp_path / "data" / "test.jsonl",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    run = _relayrl(
        "run", str(REPO / "examples" / "smollm2-arithmetic.yaml"), *args, cwd=tmp_path, timeout=2400
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    run_dir = next((tmp_path / "runs").glob("smollm2-arithmetic-*"))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in recs if "eval_accuracy" in r]
    assert len(steps) == 8 and all(r["train_samples"] > 0 for r in steps)
    assert [s for s, _ in evals] == [0, 4, 8]
    first, last = evals[0][1], evals[-1][1]
    assert last >= first + 0.2, f"held-out sampled accuracy did not rise by 0.2: {evals}"
    # The rise is in correct answers, not only the 0.1 a well-formed wrong one earns: the share
    # of correct training samples rose too (first two steps against the last two).
    early, late = (sum(r["reward_correctness"] for r in pair) / 2 for pair in (steps[:2], steps[-2:]))
    assert late > early, (early, late)
    # The curve a user sees.
    assert (run_dir / "reward_curve.png").is_file()
