"""Black-box agents learn through the gateway on the CPU: ``relayrl run`` of the README's agent
examples as a user runs them, the model built by the run (calc's warm start):

- ``calc-harness``: ``examples/calc-harness-tiny.yaml``, a scripted agent (standard library);
- ``calc-langchain``: ``examples/calc-langchain-tiny.yaml``, an agent written with LangChain
  (``examples/agents/langchain_calc``), installed into the sandbox from its requirements (here
  from the wheels ``scripts/test.sh`` fetched: no test reaches past loopback).

Each must raise held-out accuracy (episodes of the same agent through the gateway) by at least
0.3 with no history break, move the agent onto the tool, and mask under 0.5% of its episodes
(each masked one is the agent's failure, never scored 0). 10-30 minutes each on 2 cores, so they
are ``long`` tests: ``pytest -m long tests/integration/test_agents_learn.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.long, pytest.mark.timeout(5400)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Where the examples' model and data go: built by the first run (calc's warm start, ~5 min),
    found by the next, as the examples share ../models/tiny-calc."""
    return tmp_path_factory.mktemp("calc")


@pytest.mark.parametrize("agent", ["calc-harness", "calc-langchain"])
def test_a_black_box_agent_learns_through_the_gateway(tmp_path, shared, agent):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed (scripts/install.sh)")
    example = yaml.safe_load((REPO / "examples" / f"{agent}-tiny.yaml").read_text())
    for spec in example["env"].get("agents", []):
        from tests.kit.agent_wheels import agent_wheels, offline

        folder = REPO / "examples" / spec["folder"]
        listed = folder / "requirements.txt"
        offline_reqs = tmp_path / f"{spec['name']}-requirements.txt"
        offline_reqs.write_text(offline(agent_wheels(listed)) + listed.read_text())
        spec.update(folder=str(folder), requirements=str(offline_reqs))
    example.update(
        runs_dir=str(tmp_path / "runs"),
        model={**example["model"], "path": str(shared / "tiny-calc")},
        data={
            **example["data"],
            "train": str(shared / "train.parquet"),
            "test": str(shared / "test.parquet"),
        },
    )
    config = tmp_path / f"{agent}.yaml"
    config.write_text(yaml.safe_dump(example))
    run = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "run", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=5000,
    )
    (tmp_path / "run.log").write_text(
        run.stdout + run.stderr
    )  # each masked episode's reason, for a look after
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    run_dir = next((tmp_path / "runs").glob(f"{example['name']}-2*"))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "tool_calls_per_episode" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in recs if "eval_accuracy" in r]
    schedule = example["schedule"]
    # Every step trains, or every group in it tied (all right or all wrong: no signal), which a
    # well-trained policy on 8 questions a step meets now and then (calc-langchain, step 27).
    assert len(steps) == schedule["steps"]
    assert all(r["train_samples"] > 0 or r["zero_signal_groups"] == r["groups"] for r in steps), steps
    assert [s for s, _ in evals] == list(range(0, schedule["steps"] + 1, schedule["eval_every"]))
    first, last = evals[0][1], evals[-1][1]
    assert last >= first + 0.3, f"held-out accuracy did not rise by 0.3: {evals}"
    tools = [r["tool_calls_per_episode"] for r in steps]
    assert min(tools[-2:]) >= 0.9, tools
    assert all(r["history_breaks"] == 0 for r in steps), [r["history_breaks"] for r in steps]
    episodes = schedule["steps"] * schedule["prompts_per_step"] * example["sampling"]["n"]
    masked = sum(r.get("env_masked", 0) for r in steps)
    assert masked < 0.005 * episodes, f"{masked} of {episodes} episodes masked"
    assert sum(r.get("env_redo", 0) for r in steps) == 0
