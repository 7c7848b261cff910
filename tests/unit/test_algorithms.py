"""The algorithm seam: a family is a module of its own and one entry in ``algorithms.FAMILIES``;
the loop, the launchers and the config take it as it is. Shown here with two made-up families
(one with a trained learner role beside the actor) driven through ``loop.Experiment`` against
the stand-ins of ``tests/kit/loop.py``."""

from __future__ import annotations

import json

import pytest
from relayrl.common.config import ConfigError
from relayrl.coordinator import algorithms
from relayrl.coordinator.algorithms import Algorithm, TrainBatch
from relayrl.coordinator.algorithms.rewards import fresh_groups
from relayrl.coordinator.derive import load_experiment
from relayrl.coordinator.loop import Experiment
from relayrl.coordinator.rollout.base import train_sample
from relayrl.coordinator.rollout.single_turn import SingleTurn
from relayrl.learner.v1 import learner_pb2 as lp

from tests.kit.loop import Generators, Learner, Rewards


class Sign(Algorithm):
    """Made up: a sample's advantage is +1 when it scored above 0, else -1."""

    names = ("sign",)

    async def batch(self, step, version, rollout):
        groups, stats = fresh_groups(self.cfg, version, rollout)
        pairs = [pair for g in groups for pair in g]
        actor = [train_sample(s, advantage=1.0 if r > 0 else -1.0) for s, r in pairs]
        return TrainBatch(actor, stats={**stats, "sign_positive": sum(r > 0 for _, r in pairs)})


class SignWithCritic(Sign):
    """Made up: Sign, with a critic trained on the rewards beside the actor, and a count it
    keeps across steps (in the coordinator's checkpoint)."""

    names = ("sign_critic",)

    @classmethod
    def roles(cls, cfg):
        return {"critic": True}

    def __init__(self, cfg, learners, run_id):
        super().__init__(cfg, learners, run_id)
        self.seen = 0

    async def batch(self, step, version, rollout):
        tb = await super().batch(step, version, rollout)
        tb.roles["critic"] = [
            lp.TrainSample(
                prompt_token_ids=s.prompt_token_ids,
                completion_token_ids=s.completion_token_ids,
                returns=[s.advantage] * len(s.completion_token_ids),
                values=[0.0] * len(s.completion_token_ids),
            )
            for s in tb.actor
        ]
        return tb

    def observe(self, batch):
        self.seen += len(batch.actor)

    def state(self):
        return {"seen": self.seen}

    def restore(self, state):
        self.seen = state.get("seen", 0)


@pytest.fixture
def registered(monkeypatch):
    """The one line a new family adds (``FAMILIES`` in ``algorithms/__init__.py``)."""
    monkeypatch.setattr(algorithms, "FAMILIES", [*algorithms.FAMILIES, Sign, SignWithCritic])


EXPERIMENT = """
model: {path: m}
data: {train: t}
sampling: {n: 2}
schedule: {steps: 3, prompts_per_step: 2, eval_every: 0, checkpoint_every: 1}
algorithm: {advantage: %s}
"""


def _experiment(tmp_path, advantage, learners=None):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT % advantage)
    cfg = load_experiment(path)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "x", "reward_model": {"ground_truth": "1"}} for i in range(8)]  # fmt: skip
    algorithm = algorithms.make(cfg, learners or {}, run_dir.name)
    gens = Generators()
    rollouts = SingleTurn(cfg, gens, Rewards())
    return Experiment(cfg, run_dir, rows, [], gens, rollouts, Learner(), algorithm)


def test_an_unregistered_family_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT % "sign")
    with pytest.raises(ConfigError, match=r"exp.yaml: algorithm.advantage: 'sign' is none of grpo, drgrpo"):
        load_experiment(path)


async def test_a_new_family_trains_through_the_loop_unchanged(tmp_path, registered):
    exp = _experiment(tmp_path, "sign")
    assert exp.cfg.role_sections().keys() == {"learner"}  # calls no role: none started
    await exp.run()
    # the stand-in rewards are the sample index: sample 0 scores 0 (-1), sample 1 scores 1 (+1)
    assert [[s.advantage for s in b] for b in exp.learner.batches] == [[-1.0, 1.0, -1.0, 1.0]] * 3
    assert [r["sign_positive"] for r in exp.records] == [2, 2, 2] and exp.version == 3


async def test_a_family_with_a_trained_role_gets_it_started_trained_and_checkpointed(tmp_path, registered):
    critic = Learner()
    exp = _experiment(tmp_path, "sign_critic", {"critic": critic})
    assert "critic" in exp.cfg.role_sections() and exp.cfg.critic.role == "critic"  # its section filled
    await exp.run()
    assert [len(b) for b in critic.batches] == [4, 4, 4] and [r["critic_loss"] for r in exp.records] == [
        0.5
    ] * 3
    assert critic.paths == ["run/checkpoints/critic"] * 3 and critic.saved == ["step1", "step2", "step3"]
    state = json.loads((exp.run_dir / "checkpoints" / "coordinator.json").read_text())
    assert state == {"tag": "step3", "step": 3, "epoch": 0, "index": 6, "seen": 12, "critic_step": 3}

    again = _experiment(tmp_path, "sign_critic", {"critic": Learner()})
    again.learner.state = {"seen": 12}
    await again.resume("step3", [])
    assert (again.algorithm.seen, again.role_steps, again.pos.step) == (12, {"critic": 3}, 3)


def test_a_role_section_the_family_does_not_call_is_refused(tmp_path, registered):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT % "sign" + "critic: {world_size: 1}\n")
    with pytest.raises(ConfigError, match="critic: algorithm.advantage sign calls no critic"):
        load_experiment(path)
