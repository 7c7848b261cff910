"""The experiment loop (``coordinator/loop.py``) against in-process stand-ins of its clients:
what it must never do whatever the services do. A checkpoint is never written twice under one
tag, ``coordinator.json`` is never half written, a stop ends the run at a step boundary with a
checkpoint even when a service hangs, and no generation is left running behind it.

The stand-ins (``tests/kit/loop.py``) answer like the real services at their contract; the
engines themselves are tested against vLLM and DeepSpeed in ``tests/integration``."""

from __future__ import annotations

import asyncio
import json

import pytest
from relayrl.coordinator import algorithms
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.loop import Experiment
from relayrl.coordinator.rollout.single_turn import SingleTurn

from tests.kit.loop import Generators, Learner, Rewards
from tests.kit.net import refused_port


def _experiment(tmp_path, steps=4, checkpoint_every=2, **schedule) -> Experiment:
    cfg = ExperimentConfig.model_validate(
        {
            "model": {"path": "m"},
            "data": {"train": "t"},
            "sampling": {"n": 2},
            "schedule": {
                "steps": steps,
                "prompts_per_step": 2,
                "eval_every": 0,
                "checkpoint_every": checkpoint_every,
                **schedule,
            },
        }
    )
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "data_source": "x",
            "reward_model": {"ground_truth": "1"},
        }
        for i in range(8)
    ]
    gens = Generators()
    rollouts, algorithm = SingleTurn(cfg, gens, Rewards()), algorithms.make(cfg, {}, run_dir.name)
    return Experiment(cfg, run_dir, rows, [], gens, rollouts, Learner(), algorithm)


def _coordinator_json(exp: Experiment) -> dict:
    return json.loads((exp.run_dir / "checkpoints" / "coordinator.json").read_text())


async def test_the_last_checkpoint_is_not_written_again_under_the_same_tag(tmp_path):
    """steps % checkpoint_every == 0: the loop saved step4 already; saving it again would
    overwrite the tag in place while coordinator.json names it (a kill then corrupts it)."""
    exp = _experiment(tmp_path, steps=4, checkpoint_every=2)
    await exp.run()
    assert exp.learner.saved == ["step2", "step4"] and _coordinator_json(exp)["tag"] == "step4"
    # the ledger: each step's prompts, in the data's (seeded) order, none twice
    from relayrl.coordinator.records.runfolder import load_records

    ledger = load_records(exp.run_dir, "ledger.jsonl")
    order = exp._order(0)
    assert [e["step"] for e in ledger] == [1, 2, 3, 4]
    assert [p for e in ledger for p in e["prompts"]] == [f"e0-{i}" for i in order]
    # a resume of the finished run loads step4 and writes nothing
    again = _experiment(tmp_path / "again", steps=4, checkpoint_every=2)
    again.run_dir = exp.run_dir
    await again.resume("step4", [])
    await again.run()
    assert again.learner.saved == [] and _coordinator_json(again)["tag"] == "step4"


async def test_coordinator_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    exp = _experiment(tmp_path, steps=2, checkpoint_every=1)
    await exp.run()
    before = (exp.run_dir / "checkpoints" / "coordinator.json").read_text()
    exp.pos.step += 1

    def crash(self, text):  # the write dies half-way
        with open(self, "w") as f:
            f.write(text[:5])
        raise OSError("disk full")

    monkeypatch.setattr(type(exp.run_dir), "write_text", crash)
    with pytest.raises(OSError):
        await exp.checkpoint()
    monkeypatch.undo()
    assert (exp.run_dir / "checkpoints" / "coordinator.json").read_text() == before
    assert [p.name for p in (exp.run_dir / "checkpoints").iterdir()] == ["coordinator.json"]  # no temp left


async def test_a_stop_while_a_generator_hangs_ends_the_run_at_once_with_a_checkpoint(tmp_path):
    """A hung generation holds nothing the run must keep: a stop abandons it (cancelled, not
    left running) and checkpoints the last step done, instead of waiting out the deadline."""
    exp = _experiment(tmp_path, steps=10, checkpoint_every=0, max_staleness=0)
    records = []

    def on_record(rec):
        records.append(rec)
        if rec["step"] == 2:
            exp.gen.hang.set()  # the next batch's generation never answers

    exp.on_record = on_record
    run = asyncio.ensure_future(exp.run())
    while not (exp.gen.hang.is_set() and exp.gen.running):
        await asyncio.sleep(0.01)
    exp.stop_requested.set()
    await asyncio.wait_for(run, 5)
    assert [r["step"] for r in records] == [1, 2] and exp.learner.saved == ["step2"]
    assert exp.gen.running == 0  # the hung call was cancelled
    assert _coordinator_json(exp) == {
        "tag": "step2",
        "step": 2,
        "epoch": 0,
        "index": 4,
    }  # GRPO keeps no state of its own and trains no role beside the actor


async def test_a_stop_during_a_train_step_waits_for_it_and_checkpoints_after(tmp_path):
    exp = _experiment(tmp_path, steps=10, checkpoint_every=0, max_staleness=1)
    gate = asyncio.Event()
    train = exp.learner.train_step

    async def slow_train(run_id, step, samples):
        if step == 2:
            exp.stop_requested.set()  # stop arrives while the learner trains
            await gate.wait()
        return await train(run_id, step, samples)

    exp.learner.train_step = slow_train
    run = asyncio.ensure_future(exp.run())
    while not exp.stop_requested.is_set():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert not run.done()  # the step under way is finished first: its update is kept
    gate.set()
    await asyncio.wait_for(run, 5)
    assert exp.pos.step == 2 and exp.learner.saved == ["step2"] and exp.gen.running == 0


async def test_a_failing_step_leaves_no_generation_running(tmp_path):
    exp = _experiment(tmp_path, steps=10, checkpoint_every=0, max_staleness=1)
    exp.gen.hang_from = 2  # the batch generated during step 1's training never finishes

    async def broken(run_id, step, samples):
        while not exp.gen.running:  # that batch is being generated
            await asyncio.sleep(0.01)
        raise RuntimeError("learner gone")

    exp.learner.train_step = broken
    with pytest.raises(RuntimeError, match="learner gone"):
        await exp.run()
    await asyncio.sleep(0.01)
    assert exp.gen.running == 0  # the overlapped batch's call was cancelled with the run


def test_a_last_metrics_line_torn_by_a_kill_is_dropped_on_resume(tmp_path):
    """A kill while a record was appended leaves half a line; the resume must neither fail on
    it nor glue the next record onto it."""
    from relayrl.coordinator.records.runfolder import load_records, rewind_records

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert [r["step"] for r in rewind_records(tmp_path, 2)] == [1, 2]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n')
    assert [r["step"] for r in load_records(tmp_path)] == [1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"ste\n{"step": 3}\n')  # damage, not a tear
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        load_records(tmp_path)


async def test_a_failed_call_names_the_service_and_the_call():
    """A run that ends on a bare DEADLINE_EXCEEDED names nobody: which service to look at?"""
    import grpc
    from relayrl.coordinator.clients.learner import LearnerClient
    from relayrl.coordinator.errors import describe

    with refused_port() as port:
        address = f"127.0.0.1:{port}"  # a port where nothing listens
        critic = LearnerClient(address, 5.0, name="critic")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:  # still the gRPC error callers act on
                await critic.train_step("run", 1, [])
        finally:
            await critic.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert describe(e.value).startswith(f"critic ({address}) TrainStep: UNAVAILABLE: ")


class _EqualRewards:
    """Every completion scored 0: every group's rewards equal, nothing to learn from."""

    async def score(self, items, request_id):
        from relayrl.reward.v1 import reward_pb2 as rw

        return [rw.RewardResult(sample_id=x.sample_id, status=rw.SCORE_STATUS_OK, reward=0.0) for x in items]


async def test_steps_that_train_nothing_raise_the_no_signal_alarm(tmp_path, caplog):
    """A collapsed policy (every answer wrong) leaves GRPO nothing to train on: the run says so
    after ``no_signal_steps`` such steps, in the log and the metrics, or fails if told to."""
    from relayrl.coordinator.records.alarms import NoTrainingSignal

    learning = _experiment(tmp_path / "learning", steps=3, checkpoint_every=0, no_signal_steps=1)
    await learning.run()
    assert [r["alarm_no_signal"] for r in learning.records if "reward_mean" in r] == [0, 0, 0]
    exp = _experiment(tmp_path / "equal", steps=4, checkpoint_every=0, no_signal_steps=3)
    exp.rollouts = SingleTurn(exp.cfg, exp.gen, _EqualRewards())
    await exp.run()
    steps = [r for r in exp.records if "reward_mean" in r]
    assert [r["train_samples"] for r in steps] == [0, 0, 0, 0]
    assert [r["alarm_no_signal"] for r in steps] == [0, 0, 1, 1]
    assert "ALARM: no sample trained in 3 training steps in a row (reward_mean 0.000)" in caplog.text
    failing = _experiment(
        tmp_path / "fail", steps=4, checkpoint_every=0, no_signal_steps=2, no_signal_alarm="fail"
    )
    failing.rollouts = SingleTurn(failing.cfg, failing.gen, _EqualRewards())
    with pytest.raises(NoTrainingSignal, match="no sample trained in 2 training steps"):
        await failing.run()
