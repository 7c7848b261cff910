"""``deploy/slurm/relayrl.sbatch`` on a real one-node Slurm (munge, slurmctld, slurmd, started
here by ``deploy/slurm/one-node-cluster.sh``; Debian's slurm-wlm, installed by scripts/install.sh),
the tiny reverse experiment on the CPU:

* two jobs at once on the one node: both run, ports and run folders apart;
* job A trains to completion: held-out accuracy rises as the embedded run's does, and Slurm
  records it COMPLETED (the job-completion record: jobcomp/filetxt);
* job B is cancelled mid-run with ``scancel``: every process of it is gone within the bound, a
  checkpoint was written; ``sbatch --resume`` continues from it, is requeued mid-run
  (``scontrol requeue``), resumes again, and completes: every step trained once, no prompt lost;
* each job's secrets (``.relayrl-slurm/<job id>/``, laid down here as ``relayrl.sbatch`` makes them
  on several nodes: on one it makes none) are gone once it ends, completed or cancelled, kept
  over the requeue; those of an earlier job killed outright are swept when the next one starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 16
STEPS_B = 16
"""Job B's run (cancelled, resumed, requeued, completed): enough steps for each to happen mid-run;
A's run is long enough to learn."""
PROMPTS_B, N_B = 8, 4
"""Job B's steps are a quarter of A's (prompts x samples): it proves no step or prompt lost over
its stops, not learning, and A trains beside it on the same two cores."""
EXPERIMENT = """
name: {name}
seed: 0
runs_dir: {runs}
model: {{path: {model}}}
data: {{train: {data}/train.parquet, test: {data}/test.parquet}}
sampling: {{n: {n}, temperature: 1.0, max_tokens: 24}}
schedule: {{steps: {steps}, prompts_per_step: {prompts}, max_staleness: 1, eval_every: 8, checkpoint_every: {every}}}
services: {{deadline_seconds: 120, stop_grace_seconds: 20}}
learner: {{world_size: 1, optim: {{lr: 2.0e-4}}}}
generator: {{engine: {{dtype: float32, max_model_len: 512, kv_cache_gib: 0.25}}}}
reward: {{workers: 1}}
"""
CANCEL_BOUND_S = 90  # scancel -> every process gone: linger (25 s) + the step's end + stops, under KillWait


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.skip("needs root and Debian's slurm-wlm (scripts/install.sh installs it as root)")
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    d = tmp_path_factory.mktemp("slurm")
    start = subprocess.run([str(REPO / "deploy/slurm/one-node-cluster.sh"), "start", str(d)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert start.returncode == 0, start.stdout + start.stderr
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf"), "RELAYRL_DEPLOY": str(REPO / "deploy")}
    try:
        yield d, env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
        subprocess.run([str(REPO / "deploy/slurm/one-node-cluster.sh"), "stop", str(d)], timeout=60)


def sbatch(env, cwd: Path, *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", f"--output={cwd}/job-%j.out", str(REPO / "deploy/slurm/relayrl.sbatch"),
                          *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def state(env, job: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


def completed(cluster_dir: Path, job: str) -> str:
    """The job's final state in Slurm's job-completion record ("" while none)."""
    path = cluster_dir / "jobcomp.txt"
    text = path.read_text() if path.exists() else ""
    states = re.findall(rf"JobId={job} .*?JobState=(\S+)", text)
    return states[-1] if states else ""


def wait_for(what, timeout: float, every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout:.0f}s")


def run_dir(runs: Path) -> Path | None:
    found = [p for p in runs.glob("*-2*") if (p / "config.yaml").exists()]
    return found[0] if found else None


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_done(run: Path | None) -> int:
    return max((r["step"] for r in records(run) if "reward_mean" in r), default=0) if run else 0


def checkpoint_step(run: Path) -> int:
    path = run / "checkpoints" / "coordinator.json"
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def _diagnose(env, job: str, out: Path, run: Path) -> str:
    show = subprocess.run(
        ["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30
    )
    text = out.read_text()[-2000:] if out.exists() else "(none)"
    return f"{show.stdout[-1500:]}\n--- {out.name}:\n{text}\n--- checkpoint step {checkpoint_step(run)}"


def processes_of(run: Path) -> list[str]:
    """Live processes whose command line names this run's folder or runs_dir (its services)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run) in cmd:
                out.append(f"{p.name}: {cmd[:200]}")
    return out


def secrets_of(submit: Path, job: str) -> Path:
    """The job's secrets as ``relayrl.sbatch`` makes them (folder mode 700, a token among them)."""
    d = submit / ".relayrl-slurm" / job
    d.mkdir(parents=True, mode=0o700)
    (d / "token").write_text("0" * 64)
    return d


def test_two_jobs_train_side_by_side_and_one_survives_scancel_and_requeue(cluster, reverse_assets, tmp_path):
    d, env = cluster
    work = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        exp = tmp_path / name / "exp.yaml"
        # B checkpoints every step: it is cancelled and requeued mid-run
        exp.write_text(textwrap.dedent(EXPERIMENT.format(
            name=f"slurm{name}", runs=tmp_path / name / "runs", model=reverse_assets / "model",
            data=reverse_assets / "data", steps=STEPS if name == "a" else STEPS_B,
            prompts=16 if name == "a" else PROMPTS_B, n=8 if name == "a" else N_B,
            every=8 if name == "a" else 1)))  # fmt: skip
        work[name] = exp
    stale = secrets_of(tmp_path / "a", "4000000")  # a job Slurm no longer knows, killed outright
    a = sbatch(env, tmp_path / "a", str(work["a"]))
    b = sbatch(env, tmp_path / "b", str(work["b"]))
    secrets = {a: secrets_of(tmp_path / "a", a), b: secrets_of(tmp_path / "b", b)}

    # Both run at once on the one node.
    wait_for(lambda: state(env, a) == "RUNNING" and state(env, b) == "RUNNING", 120)
    run_b = wait_for(lambda: run_dir(tmp_path / "b" / "runs"), 300)
    wait_for(lambda: steps_done(run_b) >= 3, 900, every=0.5)  # B steps take ~1 s: catch it early
    run_a = run_dir(tmp_path / "a" / "runs")
    assert run_a is not None and run_a != run_b
    ports = [sorted(p.read_text().strip() for p in (r / "logs").glob("*.port")) for r in (run_a, run_b)]
    assert ports[0] and ports[1] and not set(ports[0]) & set(ports[1])  # every service on a port of its own

    # scancel B mid-run: a checkpoint, then nothing of B left.
    t0 = time.monotonic()
    subprocess.run(["scancel", b], env=env, check=True, timeout=30)
    wait_for(lambda: completed(d, b), CANCEL_BOUND_S)
    wait_for(lambda: not processes_of(run_b), CANCEL_BOUND_S - (time.monotonic() - t0), every=1.0)
    saved = json.loads((run_b / "checkpoints" / "coordinator.json").read_text())
    assert saved["step"] >= 3, saved
    assert completed(d, b) == "CANCELLED"
    wait_for(lambda: not secrets[b].exists(), 60, every=1.0)  # its batch step's last act
    assert not stale.exists()  # swept when A started

    # Resume B by sbatch; requeue it mid-run; it resumes again and completes. "Mid-run" is read
    # from the checkpoint only the resumed job can write (metrics.jsonl may still hold B's
    # records past its checkpoint until the resumed coordinator cuts them).
    b2 = sbatch(env, tmp_path / "b", "--resume", str(run_b))
    secrets[b2] = secrets_of(tmp_path / "b", b2)
    out_b2 = tmp_path / "b" / f"job-{b2}.out"
    wait_for(lambda: checkpoint_step(run_b) >= saved["step"] + 2, 900, every=0.5)
    assert state(env, b2) == "RUNNING", _diagnose(env, b2, out_b2, run_b)
    subprocess.run(["scontrol", "requeue", b2], env=env, check=True, timeout=30)
    try:
        wait_for(lambda: "(restart 1)" in out_b2.read_text(), 300)
    except AssertionError as e:
        raise AssertionError(
            f"the requeued job did not start again: {_diagnose(env, b2, out_b2, run_b)}"
        ) from e
    assert (secrets[b2] / "token").exists()  # the requeued job still needs them
    wait_for(lambda: completed(d, b2) == "COMPLETED", 1800, every=5.0)
    assert f"slurm: job {b2} requeued (restart 1): resuming {run_b}" in out_b2.read_text()

    # A: trained to completion, recorded COMPLETED, held-out accuracy up as the embedded run's.
    wait_for(lambda: completed(d, a) == "COMPLETED", 1800, every=5.0)
    recs = records(run_a)
    evals = [r["eval_accuracy"] for r in recs if "eval_accuracy" in r]
    assert [r["step"] for r in recs if "reward_mean" in r] == list(range(1, STEPS + 1))
    assert evals[-1] >= evals[0] + 0.10, evals
    assert (run_a / "reward_curve.png").is_file() and (run_a / "logs" / "learner.log").is_file()

    # B: every step trained once across three jobs, and each step's prompts once.
    assert [r["step"] for r in records(run_b) if "reward_mean" in r] == list(range(1, STEPS_B + 1))
    ledger = [json.loads(x) for x in (run_b / "ledger.jsonl").read_text().splitlines() if x.strip()]
    assert [e["step"] for e in ledger] == list(range(1, STEPS_B + 1))
    prompts = [p for e in ledger for p in e["prompts"]]
    assert len(prompts) == len(set(prompts)) == STEPS_B * PROMPTS_B  # no prompt lost, none trained twice
    assert not processes_of(run_a) and not processes_of(run_b)
    # Every job's secrets gone with it (B2's only at its end: kept over its requeue, above).
    wait_for(lambda: not any(path.exists() for path in secrets.values()), 60, every=1.0)
