"""Environments written for other ecosystems train on the embedded default from a config alone
(``relayrl run``, every service a local process, the tiny model of the reverse assets):

- a reasoning-gym task by name (``data.generate.task: reasoning_gym/<name>``), scored by its own
  ``score_answer`` through the reward plugin ``relayrl.reward.gym:score``;
- TRL's environment class as its docs write it (``tests/kit/trl_envs.py``: ``GuessEnv``, a tool per
  action, a reward function that receives the environments), named in ``env.plugins`` and
  ``env.reward_funcs``;
- an OpenEnv environment on its own server (``tests/kit/openenv_guess.py``, OpenEnv's
  ``create_app`` under uvicorn), named by URL in ``env.openenv``;
- a verifiers environment (``tests/kit/verifiers_envs/reverse_vf.py``, a taskset as verifiers'
  docs write one), named in ``env.verifiers``, its rows written from its tasks
  (``data.generate.task: verifiers/<name>``): each rollout verifiers' own, in the sandbox through
  the gateway, scored by its own rubric.

Each run trains 3 steps: every step is recorded with its groups scored (no reward error, nothing
masked), the learner stepped, and for the episodes the env's tools offered to the model."""

from __future__ import annotations

import contextlib
import json
import shutil
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_e2e import _records, _relayrl

pytestmark = pytest.mark.slow
TRL_ENVS = Path(__file__).resolve().parents[1] / "kit" / "trl_envs.py"

COMMON = """
seed: 0
runs_dir: runs
model:
  path: {model}
sampling: {{n: 4, temperature: 1.0, max_tokens: 24}}
algorithm: {{advantage: reinforce_pp}}
schedule: {{steps: 3, prompts_per_step: 4, max_staleness: 0, eval_every: 0, checkpoint_every: 0}}
services: {{deadline_seconds: 120}}
learner: {{world_size: 1, optim: {{lr: 1.0e-4}}}}
generator: {{engine: {{dtype: float32, max_model_len: {max_len}, kv_cache_gib: 0.25}}}}
"""

GYM = """
name: gym
data:
  train: {root}/gym-train.jsonl
  generate: {{task: reasoning_gym/leg_counting, n_train: 64, n_test: 0, seed: 0}}
reward: {{workers: 1, plugins: [relayrl.reward.gym:score]}}
"""

TRL = """
name: trl
data:
  train: {root}/trl-train.jsonl
env: {{plugins: ["my_trl_envs:GuessEnv"], reward_funcs: ["my_trl_envs:reward_func"]}}
episodes: {{env: guessenv, tool_format: hermes, max_turns: 3, max_episode_tokens: 200, zero_tool_alarm: warn}}
reward: {{workers: 1}}
"""


OPENENV = """
name: openenv
data:
  train: {root}/openenv-train.jsonl
env: {{openenv: [{{name: guess-openenv, url: "{url}", max_turns: 3}}]}}
episodes: {{env: guess-openenv, tool_format: hermes, max_turns: 3, max_episode_tokens: 200, zero_tool_alarm: warn}}
reward: {{workers: 1}}
"""


VERIFIERS = """
name: verifiers
data:
  train: {root}/vf-train.jsonl
  generate: {{task: verifiers/reverse-vf, n_train: 48, n_test: 0, seed: 0}}
env:
  verifiers: [{{name: reverse-vf, taskset: reverse_vf, folder: "{kit}", requirements: "{reqs}", max_turns: 1}}]
episodes: {{env: reverse-vf, tool_format: hermes, max_turns: 1, max_episode_tokens: 200}}
reward: {{workers: 1}}
"""
VERIFIERS_KIT = Path(__file__).resolve().parents[1] / "kit" / "verifiers_envs"


def _steps(root, name):
    run_dir = next((root / "runs").glob(f"{name}-*"))
    return [r for r in _records(run_dir) if "reward_mean" in r]


@pytest.mark.parametrize("standard", ["reasoning-gym", "trl", "openenv", "verifiers"])
def test_an_environment_of_another_ecosystem_trains_three_steps_from_a_config(
    standard, tmp_path, reverse_assets
):
    pytest.importorskip("reasoning_gym")
    from tests.kit.openenv_guess import GuessEnvironment, serve

    overrides = []
    reqs = tmp_path / "vf-requirements.txt"
    if standard == "verifiers":
        if shutil.which("bwrap") is None:
            pytest.skip("verifiers' rollouts run in the sandbox: bubblewrap not installed")
        from tests.kit.agent_wheels import agent_wheels, offline

        listed = VERIFIERS_KIT / "requirements.txt"
        reqs.write_text(offline(agent_wheels(listed)) + listed.read_text())
        # each rollout a job of its own that imports verifiers (~3 CPU-s): 1 prompt x n 2 a step;
        # a black-box episode may be several samples: a group baseline, not per-token returns
        overrides = ["services.gateway_replicas=1", "schedule.prompts_per_step=1", "sampling.n=2"]
        overrides += ["algorithm.advantage=grpo"]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(serve()) if standard == "openenv" else ""
        body = {"reasoning-gym": GYM, "trl": TRL, "openenv": OPENENV, "verifiers": VERIFIERS}[standard]
        exp = tmp_path / "exp.yaml"
        exp.write_text(
            # an Action's JSON schema in the system prompt: longer than the other envs' tools
            textwrap.dedent(COMMON.format(model=reverse_assets / "model", max_len=1024 if url else 512))
            + textwrap.dedent(body.format(root=tmp_path, url=url, kit=VERIFIERS_KIT, reqs=reqs))
        )
        if standard == "trl":  # the user's module beside the config
            shutil.copy(TRL_ENVS, tmp_path / "my_trl_envs.py")
        if standard in ("trl", "openenv"):  # the dataset: a prompt and the column reset takes
            rows = [
                {
                    "data_source": "guess",
                    "prompt": [{"role": "user", "content": "Play."}],
                    "secret": k % 9 + 1,
                }
                for k in range(32)
            ]
            (tmp_path / f"{standard}-train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        begun = GuessEnvironment.resets
        res = _relayrl("run", str(exp), *[a for o in overrides for a in ("--set", o)], cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = _steps(tmp_path, {"reasoning-gym": "gym"}.get(standard, standard))
    assert [r["step"] for r in steps] == [1, 2, 3]
    groups = 1 if standard == "verifiers" else 4
    for r in steps:
        assert r["groups"] == groups and r["reward_errors"] == 0 and r.get("env_masked", 0) == 0, r
        if standard == "verifiers":  # a group of 2: a step whose group ties trains nothing
            assert r.get("train_tokens", 0) > 0 or r["zero_signal_groups"] == groups, r
        else:
            assert r["train_tokens"] > 0 and "loss" in r, r
    if standard == "verifiers":  # rows from its tasks; every rollout scored by its rubric
        rows = [json.loads(x) for x in (tmp_path / "vf-train.jsonl").read_text().splitlines()]
        assert (
            len(rows) == 48 and rows[0]["data_source"] == "verifiers/reverse-vf" and "task_index" in rows[0]
        )
        assert all(r["history_breaks"] == 0 for r in steps), steps
        assert any(r["reward_mean"] > 0 for r in steps), steps  # the tiny reverse model tags answers
        assert any(r.get("train_tokens", 0) > 0 and "loss" in r for r in steps), steps
    if standard == "openenv":  # every episode a session on the server: 3 steps x 4 prompts x n 4
        assert GuessEnvironment.resets - begun == 48
    if standard == "reasoning-gym":
        rows = [json.loads(x) for x in (tmp_path / "gym-train.jsonl").read_text().splitlines()]
        assert len(rows) == 64 and rows[0]["data_source"] == "reasoning_gym/leg_counting"
    else:
        assert all(r["turns_per_episode"] >= 1 for r in steps)
