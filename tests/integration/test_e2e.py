"""The whole system on the embedded default: four real services, real learning, resume, faults."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

pytestmark = pytest.mark.slow

EXPERIMENT = """
name: e2e
seed: 0
runs_dir: runs
model:
  path: {model}
  tiny: {{task: reverse, sft_steps: 50, seed: 0}}
data:
  train: {data}/train.parquet
  test: {data}/test.parquet
  generate: {{task: reverse, n_train: 2000, n_test: 128, seed: 0}}
sampling: {{n: 8, temperature: 1.0, max_tokens: 24}}
schedule: {{steps: 20, prompts_per_step: 16, max_staleness: 1, eval_every: 10, checkpoint_every: 10}}
services: {{deadline_seconds: 120}}
learner: {{world_size: 2, optim: {{lr: 2.0e-4}}}}
generator: {{engine: {{dtype: float32, max_model_len: 512, kv_cache_gib: 0.25}}}}
reward: {{workers: 1}}
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, reverse_assets):
    """A warm-started tiny model and the reverse data (built once per session)."""
    root = tmp_path_factory.mktemp("e2e")
    exp = root / "exp.yaml"
    exp.write_text(
        textwrap.dedent(EXPERIMENT.format(model=reverse_assets / "model", data=reverse_assets / "data"))
    )
    return root, exp


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _relayrl(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _sets(*overrides: str) -> list[str]:
    """``relayrl run`` arguments setting each ``KEY=VALUE``."""
    return [arg for o in overrides for arg in ("--set", o)]


def test_grpo_raises_heldout_accuracy(workspace):
    """GRPO through the whole system on two ZeRO-3 ranks: held-out accuracy rises, no prompt is
    lost, every push reaches the generator. Resuming such a run is proven where more can go
    wrong: PPO's (critic and KL controller), the crashed learner's (identical steps) and every
    fault of the chaos suite (two ranks, no step or prompt lost or repeated)."""
    root, exp = workspace
    res = _relayrl("run", str(exp), cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = next((root / "runs").glob("e2e-*"))
    recs = _records(run_dir)
    evals = [r["eval_accuracy"] for r in recs if "eval_accuracy" in r]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(evals) == 3 and len(steps) == 20
    assert evals[-1] >= evals[0] + 0.10, f"held-out accuracy did not rise clearly: {evals}"
    assert all(r["time_eval"] > 0 for r in recs if "eval_accuracy" in r)  # timed apart from training
    for r in steps:
        assert r["groups"] == 16  # no prompt lost
        if r["train_samples"]:  # every sync reached every generator with verified checksums
            assert r["synced_replicas"] == r["healthy_generators"] == 1
    assert [r["policy_version"] for r in steps] == sorted(r["policy_version"] for r in steps)
    assert all(r["staleness_max"] <= 1 for r in steps)
    for name in ("config.yaml", "launch.jsonl", "reward_curve.png", "checkpoints/coordinator.json"):
        assert (run_dir / name).exists(), name
    launched = [json.loads(line)["name"] for line in (run_dir / "launch.jsonl").read_text().splitlines()]
    assert sorted(launched) == ["gen-0", "learner", "reward-0"]
    assert "held-out greedy accuracy" in res.stdout


def test_reinforce_pp_trains_on_per_token_advantages_and_raises_heldout_accuracy(workspace):
    """REINFORCE++ (token-level returns whitened over the batch) through the whole system: the
    learner takes per-token advantages and the policy learns (0.648 -> 0.766 here when written,
    at 12 and at 16 steps; the bound leaves half of that rise as margin)."""
    root, exp = workspace
    over = _sets("name=rpp", "algorithm.advantage=reinforce_pp", "schedule.steps=12", "schedule.eval_every=6")
    over += _sets("tracking.tensorboard=true")
    res = _relayrl("run", str(exp), *over, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = next((root / "runs").glob("rpp-*"))
    recs = _records(run_dir)
    # the TensorBoard event files asked for hold the run's metrics, step by step, as metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    logged = ea.Scalars("reward_mean")  # float32 in the event file
    want = [r for r in recs if "reward_mean" in r]
    assert [e.step for e in logged] == [r["step"] for r in want]
    assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in want], abs=1e-6)
    assert not (run_dir / "wandb").exists()  # not asked for: not there
    evals = [r["eval_accuracy"] for r in recs if "eval_accuracy" in r]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 12 and all(r["train_samples"] > 0 for r in steps)
    assert not any("zero_signal_groups" in r for r in steps)  # no group baseline: no group left out for it
    assert evals[-1] >= evals[0] + 0.05, f"held-out accuracy did not rise: {evals}"


def test_ppo_with_critic_and_reference_services_learns_then_resumes(workspace):
    """PPO as verl runs it, each role its own service: GAE on the critic's values, a KL penalty to
    the reference's log-probs in the reward with the adaptive controller, actor and critic trained
    in the same step. It must raise held-out accuracy as much as the GRPO test asks (0.648 -> 0.805
    when written), and a resume must continue the critic and the KL controller where they were."""
    root, exp = workspace
    over = _sets("name=ppo", "algorithm.advantage=gae", "algorithm.kl_coef=0.05", "algorithm.kl_target=0.01")
    over += _sets(
        "algorithm.kl_horizon=500",
        "schedule.steps=12",
        "schedule.eval_every=6",
        "schedule.checkpoint_every=6",
        # one rank per role (ZeRO-3 over two ranks: the GRPO test, chaos; two critic ranks: Ray's PPO)
        "learner.world_size=1",
    )
    res = _relayrl("run", str(exp), *over, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = next((root / "runs").glob("ppo-*"))
    launched = [json.loads(line)["name"] for line in (run_dir / "launch.jsonl").read_text().splitlines()]
    assert sorted(launched) == ["critic", "gen-0", "learner", "reference", "reward-0"]
    recs = _records(run_dir)
    evals = [r["eval_accuracy"] for r in recs if "eval_accuracy" in r]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 12 and all(r["train_samples"] > 0 for r in steps)
    assert evals[-1] >= evals[0] + 0.10, f"held-out accuracy did not rise clearly: {evals}"
    assert all(r["critic_loss"] > 0 and "critic_explained_var" in r for r in steps)  # trained each step
    # the KL is measured against the reference: ~0 while the samples come from the initial
    # policy (steps 1 and 2, with one step of staleness), then the drift (0.04 to 0.09 here)
    assert all(abs(r["kl_reward"]) < 1e-3 for r in steps[:2]), [r["kl_reward"] for r in steps]
    assert sum(r["kl_reward"] for r in steps[2:]) / 10 > 0.01, [r["kl_reward"] for r in steps]
    # the critic learned the scale of the returns: its values start at 0 and follow them
    assert steps[0]["critic_values_mean"] == 0.0
    assert abs(steps[-1]["critic_values_mean"] - steps[-1]["returns_mean"]) < steps[-1]["returns_mean"]
    # the adaptive controller moved the coefficient (every step's KL is far from its target)
    coefs = [r["kl_coef"] for r in steps]
    assert coefs[0] == 0.05 and len(set(coefs)) == len(coefs)
    state = json.loads((run_dir / "checkpoints" / "coordinator.json").read_text())
    assert state["critic_step"] == 12
    # the progress line shows the value loss, explained variance and the KL in the reward
    line = next(x for x in res.stdout.splitlines() if x.startswith("step 12/12"))
    for name in ("critic_loss", "critic_explained_var", "kl_reward", "kl_coef"):
        assert f"{name} " in line, line

    res = _relayrl("run", "--resume", str(run_dir), "--set", "schedule.steps=14", cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed {run_dir.name} at step 12" in res.stdout
    steps = [r for r in _records(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 15))
    assert steps[12]["kl_coef"] == pytest.approx(state["kl_coef"])  # the controller went on from its state
    assert json.loads((run_dir / "checkpoints" / "coordinator.json").read_text())["critic_step"] == 14
    # the critic went on from its checkpoint: values where they were, not back at zero
    assert steps[12]["critic_values_mean"] > 0.5 * steps[11]["critic_values_mean"] > 0


def _programmatic(root: Path, exp: Path, overrides: list[str], on_record):
    """Run the coordinator in this process against embedded services the test can kill."""
    from relayrl.coordinator.derive import load_experiment
    from relayrl.coordinator.drive import drive
    from relayrl.coordinator.launch.local import LocalServices
    from relayrl.coordinator.records.runfolder import new_run_dir

    cfg = load_experiment(exp, overrides)
    run_dir = new_run_dir(cfg)
    services = LocalServices(cfg, run_dir)
    services.start()
    return (
        cfg,
        run_dir,
        services,
        lambda: asyncio.run(drive(cfg, run_dir, services, False, on_record=on_record(services))),
    )


def test_a_generator_killed_while_the_learner_trains_costs_one_push_not_the_other_replica(
    workspace, monkeypatch, caplog
):
    """A generator dies after its last samples, before the push (an OOM kill while the learner
    trains): the learner's broadcast to the gloo group that still holds it fails. The other
    replica, already waiting for the first bucket, must stop within a second (the learner
    marks the push abandoned), not at the group's timeout (minutes): the push is retried without
    the dead one and the run goes on at full speed with one replica, to the end: with no
    restarts it stays dead. (A replica killed mid-generation, its prompts sampled again by the
    other one: the restart test below.)"""
    from relayrl.coordinator.clients.learner import LearnerClient

    box: dict = {}
    train_step = LearnerClient.train_step

    async def killing_train_step(self, run_id, step, samples):
        if step == 3 and "killed" not in box:
            proc = next(p for p in box["services"].procs if p.name == "gen-1")
            proc.kill()
            proc.proc.wait(30)
            box["killed"] = step
        return await train_step(self, run_id, step, samples)

    monkeypatch.setattr(LearnerClient, "train_step", killing_train_step)
    root, exp = workspace
    cfg, run_dir, services, go = _programmatic(
        root,
        exp,
        [
            "schedule.steps=5",
            "schedule.eval_every=0",
            "schedule.max_staleness=0",  # nothing generates while the learner trains
            "services.generator_replicas=2",
            "services.restarts=0",  # it stays dead: the run goes on with one
            "learner.world_size=1",
            "learner.weight_sync_transport=gloo",
            "name=killed-in-training",
        ],
        lambda services: None,
    )
    box["services"] = services
    caplog.set_level("INFO", logger="relayrl.coordinator")
    try:
        exp_done = go()
        status = asyncio.run(_generator_status(services.generators["gen-0"]))
    finally:
        services.stop()
    steps = [r for r in exp_done.records if "reward_mean" in r]
    assert box.get("killed") == 3 and len(steps) == 5
    assert all(r["groups"] == 16 for r in steps)
    messages = [r.getMessage() for r in caplog.records]
    assert any("weight push of version 3 failed" in m for m in messages), messages
    third = steps[2]
    assert (third["synced_replicas"], third["healthy_generators"]) == (1, 1), third
    assert steps[0]["healthy_generators"] == 2 and steps[-1]["healthy_generators"] == 1
    assert all(r["synced_replicas"] == r["healthy_generators"] for r in steps if r["train_samples"]), steps
    # the retry found the survivor free at once (stuck, it would have taken minutes)
    assert third["time_sync"] < 30, [r["time_sync"] for r in steps]
    assert (status.ready, status.policy_version) == (True, 5)


@pytest.mark.parametrize(
    "replicas, transport",
    [(1, "auto"), (2, "gloo")],
    ids=["the-only-generator", "one-of-two-over-a-gloo-group"],
)
def test_a_generator_killed_and_started_again_rejoins_at_the_learners_weights(
    workspace, caplog, replicas, transport
):
    """What a container restart does (a crash, an OOM kill, `docker compose restart`): a
    generator dies mid-generation and the embedded supervisor starts a new process at the same
    address a little later, as Kubernetes or compose would. The run goes on (with one replica it
    waits for it instead of failing), registers it again, gives it the learner's current
    weights before it samples (the new process loaded the initial ones), and loses no prompt.
    With two replicas in one gloo group the other one is current when the returning one is
    pushed that version: it drains the broadcast and keeps its weights (the learner's mixed
    push); a survivor whose load the dead peer broke comes back too."""
    import time

    root, exp = workspace
    victim = f"gen-{replicas - 1}"
    box: dict = {}

    def on_record(services):
        def f(rec):
            if rec.get("step") == 2 and "reward_mean" in rec and "killed" not in box:
                old = next(p for p in services.procs if p.name == victim)
                old.kill()  # the next batch is generating (max_staleness 1): its call fails
                box["killed"], box["version_at_kill"] = old, rec["policy_version"]
                if replicas > 1:
                    # The run does not wait for it (the other replica samples): let it come up
                    # before the last steps, so it returns while the other one is current.
                    deadline = time.monotonic() + 180
                    while time.monotonic() < deadline and not any(
                        p.name == victim and p is not old and p.address for p in list(services.procs)
                    ):
                        time.sleep(0.5)

        return f

    cfg, run_dir, services, go = _programmatic(
        root,
        exp,
        [
            "schedule.steps=8",  # a few steps after the return: it is probed every 5 s
            "schedule.eval_every=0",
            "learner.world_size=1",
            f"learner.weight_sync_transport={transport}",
            f"services.generator_replicas={replicas}",
            "services.replica_wait_seconds=300",
            f"name=restart-{replicas}",
        ],
        on_record,
    )
    caplog.set_level("INFO", logger="relayrl.coordinator.clients.rotation")
    try:
        exp_done = go()
        statuses = {name: asyncio.run(_generator_status(a)) for name, a in services.generators.items()}
    finally:
        services.stop()
    steps = [r for r in exp_done.records if "reward_mean" in r]
    assert services.restarted == {victim: 1} and len(steps) == 8
    assert all(r["groups"] == 16 for r in steps)  # every prompt of every step scored exactly once
    # Out of rotation for a while (seen with one replica: step 3 recorded 0 healthy, 0 synced),
    # then back in, and the last push reached every replica.
    rotation = [(r["step"], r["healthy_generators"], r["synced_replicas"]) for r in steps]
    assert steps[-1]["healthy_generators"] == replicas == steps[-1]["synced_replicas"], rotation
    assert steps[-1]["policy_version"] == 8 and box["version_at_kill"] == 2
    # and it sampled with the learner's weights, never the initial ones: no group was too stale
    assert all(r["dropped_stale_groups"] == 0 and r["staleness_max"] <= 1 for r in steps), steps
    messages = [r.getMessage() for r in caplog.records]
    assert any(victim in m and "taken out of rotation" in m for m in messages), messages
    assert any(victim in m and "back in rotation" in m for m in messages), messages
    # every process, the new one included, holds the last weights
    assert {n: (s.ready, s.policy_version) for n, s in statuses.items()} == {
        f"gen-{i}": (True, 8) for i in range(replicas)
    }
    if transport == "gloo":
        learner_log = (run_dir / "logs" / "learner.log").read_text()
        assert f"{victim}: weight transport gloo" in learner_log


async def _generator_status(address: str):
    from relayrl.generator.v1 import generator_pb2, generator_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        return await generator_pb2_grpc.GeneratorServiceStub(ch).GetStatus(
            generator_pb2.GetStatusRequest(), timeout=30
        )


def test_a_learner_crash_stops_the_run_and_its_resume_continues_identically(workspace):
    """The learner dies after step 3, its last checkpoint at step 2. The resume starts at step 2
    and does step 3 again: with sampling seeded and no staleness it must be the very step the
    crashed run did (same samples, rewards and loss), and the run folder keeps each step once
    (the crashed run's step 3 moves to ``metrics.rewound.jsonl``)."""
    root, exp = workspace

    def on_record(services):
        def f(rec):
            if rec.get("step") == 3 and "reward_mean" in rec:
                next(p for p in services.procs if p.name == "learner").kill()

        return f

    cfg, run_dir, services, go = _programmatic(
        root,
        exp,
        [
            "schedule.steps=8",
            "schedule.eval_every=0",
            "schedule.checkpoint_every=2",
            "schedule.max_staleness=0",
            "learner.world_size=1",
            "services.deadline_seconds=30",
            "name=fault-learner",
        ],
        on_record,
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            go()
    finally:
        services.stop()
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    state = json.loads((run_dir / "checkpoints" / "coordinator.json").read_text())
    assert state["tag"] == "step2" and (run_dir / "checkpoints" / "step2").is_dir()
    crashed = {r["step"]: r for r in _records(run_dir) if "reward_mean" in r}
    assert sorted(crashed) == [1, 2, 3]

    res = _relayrl("run", "--resume", str(run_dir), *_sets("schedule.steps=4"), cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed {run_dir.name} at step 2" in res.stdout
    steps = {r["step"]: r for r in _records(run_dir) if "reward_mean" in r}
    assert sorted(steps) == [1, 2, 3, 4]  # each step once
    rewound = [json.loads(line) for line in (run_dir / "metrics.rewound.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rewound] == [3] and rewound[0]["time"] == crashed[3]["time"]
    again, before = steps[3], crashed[3]
    assert again["time"] > before["time"]  # done again, not kept
    for key in ("reward_mean", "completion_len_mean", "completion_len_max", "train_samples"):
        assert again[key] == before[key], (key, again[key], before[key])
    assert again["loss"] == pytest.approx(before["loss"], rel=1e-4, abs=1e-6)
    assert steps[4]["policy_version"] > steps[3]["policy_version"]
