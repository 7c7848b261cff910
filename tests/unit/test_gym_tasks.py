"""reasoning-gym tasks by name (``relayrl.common.data.gym``, ``relayrl.reward.gym``): rows in verl's
schema, the same for the same arguments, splits disjoint, the dataset's parameters passed on and
relayrl's refused; scored by the task's own ``score_answer`` on the ``<answer>`` given (never a
crash on a completion without one); the experiment config names what is missing."""

from __future__ import annotations

import json

import pytest
from relayrl.common.data.tasks import generate
from relayrl.coordinator.config import ExperimentConfig, TaskDataSpec

rg = pytest.importorskip("reasoning_gym")
TASK = "reasoning_gym/leg_counting"


def test_rows_are_verl_rows_repeatable_with_disjoint_splits():
    train = generate(TASK, 40, seed=3)
    assert train == generate(TASK, 40, seed=3)
    assert train != generate(TASK, 40, seed=4)
    test = generate(TASK, 10, seed=3, split="test")
    questions = [r["prompt"][-1]["content"] for r in train]
    assert len(set(questions)) == 40 and not set(questions) & {r["prompt"][-1]["content"] for r in test}
    row = train[0]
    assert row["data_source"] == TASK and row["prompt"][0]["role"] == "system"
    assert "<answer>" in row["prompt"][0]["content"] and row["extra_info"]["split"] == "train"
    entry = json.loads(row["extra_info"]["entry"])
    assert entry["question"] == row["prompt"][-1]["content"]
    assert entry["answer"] == row["reward_model"]["ground_truth"]


def test_the_datasets_parameters_reach_it_and_bad_ones_are_refused():
    rows = generate(TASK, 8, seed=0, min_animals=1, max_animals=1)
    assert all(json.loads(r["extra_info"]["entry"])["metadata"]["num_animals"] == 1 for r in rows)
    with pytest.raises(ValueError, match="relayrl's"):
        generate(TASK, 1, seed=0, size=5)
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        generate("reasoning_gym/no_such_task", 1, seed=0)
    with pytest.raises(ValueError, match="leg_counting"):
        generate(TASK, 1, seed=0, no_such_param=1)


def test_the_scorer_uses_the_tasks_own_score_on_the_answer_tag():
    from relayrl.reward.gym import score

    assert TASK in score.data_sources and len(score.data_sources) > 50
    row = generate(TASK, 1, seed=0)[0]
    truth = row["reward_model"]["ground_truth"]
    right = score(f"Thinking... <answer>{truth}</answer>", truth, row["extra_info"])
    assert right.reward == 1.0 and right.components == {"formatted": 1.0, "correct": 1.0}
    wrong = score(f"<answer>{int(truth) + 1}</answer>", truth, row["extra_info"])
    assert wrong.reward < 1.0 and wrong.components["correct"] == 0.0
    bare = score(truth, truth, row["extra_info"])  # no <answer> tag: no answer given
    assert bare.reward == 0.0 and bare.components["formatted"] == 0.0


def test_the_experiment_config_names_what_a_gym_task_needs():
    assert TaskDataSpec(task=TASK, n_train=4, n_test=0).task == TASK
    with pytest.raises(ValueError, match="neither a built-in task"):
        TaskDataSpec(task="no_such_task")
    raw = {
        "model": {"path": "m"},
        "data": {"train": "t.jsonl", "generate": {"task": TASK, "n_train": 4, "n_test": 0}},
    }
    with pytest.raises(ValueError, match="reward.plugins: .*relayrl.reward.gym:score"):
        ExperimentConfig.model_validate(raw)
    ok = ExperimentConfig.model_validate({**raw, "reward": {"plugins": ["relayrl.reward.gym:score"]}})
    assert ok.data.generate.task == TASK
