"""Multi-turn episodes on the real stack (vLLM, DeepSpeed, the env service, the coordinator): the
learner trains on exactly the tokens the generator sampled plus the environment's, seeded runs
repeat, an env replica that dies costs a redo and no fabricated reward, and an environment that
expects tools but sees none raises the alarm."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_e2e import _programmatic, _records, _relayrl, _sets

pytestmark = pytest.mark.slow

EXPERIMENT = """
name: turns
seed: 0
runs_dir: runs
model:
  path: {model}
data:
  train: {data}/guess-train.jsonl
  test: {data}/guess-test.jsonl
  generate: {{task: guess, n_train: 200, n_test: 8, seed: 0}}
episodes: {{env: guess, tool_format: "", max_turns: 4, max_episode_tokens: 200}}
sampling: {{n: 4, temperature: 1.0, max_tokens: 16}}
# REINFORCE++ trains every episode, also when a group's rewards are all equal (this model, warm
# started on another task, rarely finds the number): the learner then scores every episode.
algorithm: {{advantage: reinforce_pp}}
schedule: {{steps: 3, prompts_per_step: 4, max_staleness: 0, eval_every: 0, checkpoint_every: 0}}
services: {{deadline_seconds: 120}}
learner: {{world_size: 1, optim: {{lr: 1.0e-4}}}}
generator: {{engine: {{dtype: float32, max_model_len: 512, kv_cache_gib: 0.25}}}}
reward: {{workers: 1}}
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, reverse_assets):
    root = tmp_path_factory.mktemp("turns")
    exp = root / "exp.yaml"
    exp.write_text(textwrap.dedent(EXPERIMENT.format(model=reverse_assets / "model", data=root / "data")))
    # The data files, made once here: every test may run alone (some drive the loop in-process,
    # which prepares nothing).
    from relayrl.coordinator.assets import prepare
    from relayrl.coordinator.derive import load_experiment

    prepare(load_experiment(exp))
    return root, exp


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "reward_mean" in r]


def _run_dir(root: Path, name: str) -> Path:
    return next((root / "runs").glob(f"{name}-*"))


def test_episodes_train_on_the_generators_tokens_and_seeded_runs_repeat(workspace):
    """Every turn extends the exact tokens before it (a violation would fail the run), the
    learner's log-probs of the trained tokens, those right after an environment span included,
    are the generator's, and a second seeded run gives the same episodes, rewards and losses."""
    root, exp = workspace
    runs = []
    for name in ("turns-a", "turns-b"):
        res = _relayrl("run", str(exp), *_sets(f"name={name}", "schedule.steps=3"), cwd=root)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs.append(_steps(_run_dir(root, name)))
    a, b = runs
    assert len(a) == len(b) == 3  # two updates in: the third step samples from trained weights
    for r in a:
        assert r["groups"] == 4 and r["env_masked"] == 0 and r["reward_errors"] == 0
        assert r["turns_per_episode"] > 1  # the bridge ran: later turns extend earlier ones
        assert r["logprob_abs_diff"] < 1e-3, r
        assert r["logprob_abs_diff_after_env"] < 1e-3, r
    _check_trace(_run_dir(root, "turns-a") / "episodes" / "first.jsonl")
    keys = (
        "reward_mean",
        "loss",
        "turns_per_episode",
        "tool_calls_per_episode",
        "gen_tokens",
        "train_tokens",
    )
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def _check_trace(path: Path) -> None:
    """The learner sample of each traced episode is the generator's ids of every turn with the
    bridge ids between them, exactly; the loss mask is 1 exactly on the generated ids."""
    episodes = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(episodes) == 2
    for ep in episodes:
        calls = [t["call"] for t in ep["turns"]]
        assert len(calls) > 1
        ids = lambda c, k: [int(x) for x in c.get(k, [])]  # noqa: E731 (protobuf JSON: int lists)
        completion, mask = [], []
        for k, c in enumerate(calls):
            prompt = ids(c, "promptTokenIds")
            before = ids(calls[0], "promptTokenIds") + completion
            if k:
                assert prompt[: len(before)] == before  # the exact tokens so far, then the bridge
                assert len(prompt) > len(before)
            bridge = prompt[len(before) :]
            completion += bridge + ids(c, "completionTokenIds")
            mask += [0.0] * len(bridge) + [1.0] * len(ids(c, "completionTokenIds"))
        assert ids(ep["sample"], "completionTokenIds") == completion
        assert ids(ep["sample"], "promptTokenIds") == ids(calls[0], "promptTokenIds")
        assert ep["loss_mask"] == mask


def test_a_killed_env_replica_costs_a_redo_and_no_fabricated_reward(workspace):
    """The env replica is killed as step 3's rollout starts (the record of step 2 is written
    after it was started and before it ran): its episodes' sessions are gone, so they are redone
    once the supervisor has it serving again; nothing is scored 0 for it, nothing is masked."""
    root, exp = workspace
    killed = {}

    def on_record(services):
        def f(rec):
            if rec.get("step") == 2 and "reward_mean" in rec and not killed:
                next(p for p in services.procs if p.name == "env-0").kill()
                killed["at"] = 2

        return f

    cfg, run_dir, services, go = _programmatic(root, exp, ["name=turns-kill", "schedule.steps=4"], on_record)
    try:
        done = go()
    finally:
        services.stop()
    steps = [r for r in done.records if "reward_mean" in r]
    assert killed and len(steps) == 4
    assert steps[2]["env_redo"] > 0, steps[2]
    assert all(r["env_masked"] == 0 and r["reward_errors"] == 0 and r["groups"] == 4 for r in steps)
    assert json.loads((run_dir / "launch.jsonl").read_text().splitlines()[-1])["name"] == "env-0"  # restarted


def test_tool_parsing_turned_off_trips_the_zero_tool_alarm_within_three_steps(workspace):
    root, exp = workspace
    sets = _sets(
        "name=turns-alarm",
        "schedule.steps=6",
        "data.train=data/calc-train.jsonl",
        "data.test=data/calc-test.jsonl",
        "data.generate.task=calc",
        "episodes.env=calc",
        'episodes.tool_format=""',
        "episodes.zero_tool_alarm=fail",
        # the tools' description in the prompt: this tokenizer has no tool text, ~550 tokens
        "generator.engine.max_model_len=1024",
    )
    res = _relayrl("run", str(exp), *sets, cwd=root)
    assert res.returncode != 0
    assert "saw none in 3 training steps" in res.stdout + res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(_steps(_run_dir(root, "turns-alarm"))) == 2  # the third step's rollout raised it


def test_stepwise_turns_render_every_call_whole_and_train_each(workspace):
    """``episodes.turns: stepwise`` on the real generator: every later call's prompt is the whole
    dialogue rendered again (the model's turns as assistant messages), and each call trains."""
    root, exp = workspace
    sets = _sets("name=turns-stepwise", "episodes.turns=stepwise", "algorithm.advantage=grpo")
    res = _relayrl("run", str(exp), *sets, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = _steps(_run_dir(root, "turns-stepwise"))
    assert len(steps) == 3
    assert all(r["turns_per_episode"] > 1 and r["env_masked"] == 0 and r["groups"] == 4 for r in steps)
