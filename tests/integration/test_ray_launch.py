"""``relayrl launch ray`` against a real Ray head on loopback (CPU): placement groups with one
bundle per learner rank and per replica, the services as actors, a short run that trains and
pushes weights, and nothing left behind, after a clean end or a Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.kit.net import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'relayrl[ray]')")
psutil = pytest.importorskip("psutil")

EXPERIMENT = """
name: {name}
runs_dir: runs
model:
  path: {root}/model
  tiny: {{task: reverse, sft_steps: 0, seed: 0}}
data:
  train: {root}/data/train.parquet
  generate: {{task: reverse, n_train: 64, n_test: 0, seed: 0}}
sampling: {{n: 4, temperature: 1.0, max_tokens: 16}}
schedule: {{steps: {steps}, prompts_per_step: 4, max_staleness: 1, eval_every: 0, checkpoint_every: 0}}
services: {{deadline_seconds: 120}}
learner: {{world_size: 2, optim: {{lr: 1.0e-4}}}}
generator: {{engine: {{dtype: float32, max_model_len: 256, kv_cache_gib: 0.25}}}}
reward: {{workers: 1, plugins: ["rayplug:score"]}}
ray:
  env: {{PYTHONPATH: "{root}"}}
"""

# A random tiny model never writes a well-formed answer, so the built-in reverse scorer gives every
# sample 0 and no group carries a gradient. This plugin (found through ray.env's PYTHONPATH, as a
# user's would be) scores a checksum of the text: rewards differ within groups, the learner trains.
PLUGIN = """
from relayrl.reward.scorers import ScoreResult


def score(completion, ground_truth, extra_info):
    return ScoreResult(float(sum(map(ord, completion)) % 7) / 6, {})


score.data_sources = ["reverse"]
"""


@pytest.fixture(scope="module")
def ray_head():
    """``ray start --head --block`` on loopback with 4 logical CPUs; stopped by its handle."""
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    temp = tempfile.mkdtemp(prefix="rr-", dir="/tmp")  # short: Ray's unix sockets live under it
    port = free_port()
    # Ray's one-machine mode keeps the node address on loopback (else the head takes the host's IP).
    # Token authentication as on a real cluster, with a token of this test's own.
    token = Path(temp) / "auth_token"
    token.write_text(uuid.uuid4().hex)
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    ray_cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(
        [
            *ray_cli,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--object-store-memory=100000000",
            f"--temp-dir={temp}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tree: list = []
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (Path(temp) / "head.log").read_text():
            assert head.poll() is None, (Path(temp) / "head.log").read_text()
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        yield {"address": f"127.0.0.1:{port}", "pid": head.pid, "env": env}
    finally:
        tree = psutil.Process(head.pid).children(recursive=True) if head.poll() is None else []
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        _gone, alive = psutil.wait_procs(tree, timeout=30)
        for p in alive:  # ours only: the head's own tree
            p.kill()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        assert not alive, f"the Ray head left processes behind: {alive}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    (root / "rayplug.py").write_text(PLUGIN)
    return root


def _experiment(root: Path, name: str, steps: int) -> Path:
    exp = root / f"{name}.yaml"
    exp.write_text(textwrap.dedent(EXPERIMENT.format(root=root, name=name, steps=steps)))
    return exp


def _launch(root: Path, head: dict, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "launch", "ray", *args, "--address", head["address"]],
        cwd=root,
        env=head["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-5000:]
    return out


def _cluster_state(head: dict, names: list[str]) -> dict:
    """Placement groups the head knows (by name: state) and which of ``names`` are live actors."""
    code = textwrap.dedent(
        f"""
        import json, ray
        from ray.util.placement_group import placement_group_table
        ray.init(address={head["address"]!r}, namespace="relayrl", log_to_driver=False)
        pgs = {{v["name"]: v["state"] for v in placement_group_table().values()}}
        live = []
        for n in {names!r}:
            try:
                ray.get_actor(n)
                live.append(n)
            except ValueError:
                pass
        print(json.dumps({{"pgs": pgs, "live": live}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=head["env"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _leftovers(head: dict, run_dir: Path) -> list[str]:
    """Processes of this run still alive: any whose command line names the run folder (every
    service's does, through its config), and any relayrl process under the head."""
    mine = []
    under_head = {p.pid for p in psutil.Process(head["pid"]).children(recursive=True)}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(run_dir) in cmd or (p.info["pid"] in under_head and "relayrl" in cmd):
            mine.append(f"{p.info['pid']}: {cmd[:200]}")
    return mine


def _wait_gone(head: dict, run_dir: Path, timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _leftovers(head, run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _until_ctrl_c(proc: subprocess.Popen, line_start: str) -> str:
    """Its output until a line starting with ``line_start`` (a step went through every service),
    then Ctrl-C once; all of it once it exited."""
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(line_start):
                break
        assert any(line.startswith(line_start) for line in lines), "".join(lines)[-5000:]
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(lines) + rest


def test_launch_ray_runs_trains_resumes_and_cleans_up(ray_head, workspace):
    """A run completes and its services and placement groups go; resumed from its checkpoint on
    fresh ones, Ctrl-C once ends the step with a checkpoint and tears everything down, exit 0,
    also when its parent started it with SIGINT ignored, as a non-interactive shell starts a
    background job (asyncio then installs no Ctrl-C handler of its own: it did nothing once)."""
    out = _finish(_launch(workspace, ray_head, str(_experiment(workspace, "rayrun", 2))))
    run_dir = next((workspace / "runs").glob("rayrun-*"))
    assert f"{run_dir.name}: completed at step 2" in out
    # Again from its checkpoint, on fresh placement groups and actors of the same names.
    proc = _launch(
        workspace,
        ray_head,
        "--resume",
        str(run_dir),
        "--set",
        "schedule.steps=500",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    out = _until_ctrl_c(proc, "step 3/")
    assert proc.returncode == 0, out[-5000:]
    assert f"resumed {run_dir.name} at step 2" in out, out[-5000:]
    assert "stopping at the end of this step with a checkpoint" in out, out[-5000:]
    assert "ray: services stopped, placement groups removed" in out, out[-5000:]

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 3
    saved = json.loads((run_dir / "checkpoints" / "coordinator.json").read_text())
    assert (
        saved["step"] == steps[-1]["step"] and f"stopped at step {steps[-1]['step']} with a checkpoint" in out
    )
    assert all(r["groups"] == 4 for r in steps)
    trained = [r for r in steps if r["train_samples"]]
    assert trained, "no step trained"
    assert all(r["synced_replicas"] == r["healthy_generators"] == 1 for r in trained)  # weights pushed
    assert steps[-1]["policy_version"] >= 1
    assert (run_dir / "checkpoints" / "coordinator.json").exists()

    record = json.loads((run_dir / "ray.json").read_text())
    pgs = {g["name"].rsplit("-", 1)[1]: g for g in record["placement_groups"]}
    assert pgs["learner"]["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert pgs["learner"]["strategy"] == "PACK" and pgs["learner"]["roles"] == ["learner-0", "learner-1"]
    assert pgs["rollout"]["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert pgs["rollout"]["roles"] == ["gen-0", "reward-0"]
    assert {g["state"] for g in record["placement_groups"]} == {"REMOVED"}
    addresses = {n: s.get("address", "") for n, s in record["services"].items()}
    assert all(addresses[n].startswith("127.0.0.1:") for n in ("learner", "gen-0", "reward-0"))

    launched = [json.loads(line) for line in (run_dir / "launch.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in launched) == sorted(
        ["gen-0", "learner", "learner-rank1", "reward-0"] * 2
    )
    ranks = {r["name"]: r["env"] for r in launched if r["name"].startswith("learner")}
    assert ranks["learner"]["RANK"] == "0" and ranks["learner-rank1"]["RANK"] == "1"
    assert {e["MASTER_ADDR"] for e in ranks.values()} == {"127.0.0.1"}
    # No port picked beforehand: rank 0's store bound one and published it in a file of the run
    # folder that its follower read; a file per launch (the run, then its resume).
    files = [r["env"]["RELAYRL_RENDEZVOUS_FILE"] for r in launched if r["name"].startswith("learner")]
    assert all("MASTER_PORT" not in r["env"] for r in launched)
    assert files[0] == files[1] != files[2] == files[3], files
    assert all(
        Path(f).parent == run_dir / "rendezvous" and 0 < int(Path(f).read_text()) < 65536 for f in files
    )

    actors = [f"{run_dir.name}-{r}" for r in ("learner-0", "learner-1", "gen-0", "reward-0")]
    state = _cluster_state(ray_head, actors)
    assert {state["pgs"][g["name"]] for g in record["placement_groups"]} == {"REMOVED"}
    assert state["live"] == []
    assert _wait_gone(ray_head, run_dir) == []


def test_launch_ray_runs_ppo_with_critic_and_reference_learners(ray_head, workspace):
    """PPO's critic and reference are learners of their own under Ray: a placement group each,
    rank 0 named after the role, trained (the critic) and asked (both) on every step."""
    over = ["--set", "algorithm.advantage=gae", "--set", "algorithm.kl_coef=0.05"]
    # 4 logical CPUs: the actor's 2 ranks, the critic's 2, the reference's 1 and the generator at
    # half a CPU each, the reward replica 1
    over += ["--set", "ray.learner_cpus_per_rank=0.5", "--set", "ray.generator_cpus=0.5"]
    out = _finish(_launch(workspace, ray_head, str(_experiment(workspace, "rayppo", 2)), *over))
    run_dir = next((workspace / "runs").glob("rayppo-*"))
    assert f"{run_dir.name}: completed at step 2" in out
    record = json.loads((run_dir / "ray.json").read_text())
    pgs = {g["name"].rsplit("-", 1)[1]: g for g in record["placement_groups"]}
    assert pgs["critic"]["roles"] == ["critic-0", "critic-1"] and pgs["reference"]["roles"] == ["reference-0"]
    assert {g["state"] for g in record["placement_groups"]} == {"REMOVED"}
    for role in ("critic", "reference"):
        assert record["services"][role]["address"].startswith("127.0.0.1:"), out
    launched = sorted(
        json.loads(line)["name"] for line in (run_dir / "launch.jsonl").read_text().splitlines()
    )
    assert launched == sorted(
        ["critic", "critic-rank1", "gen-0", "learner", "learner-rank1", "reference", "reward-0"]
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["critic_loss"] > 0 and "kl_reward" in r for r in steps), steps
    assert _wait_gone(ray_head, run_dir) == []
