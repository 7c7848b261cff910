"""The learner service's other roles, on real DeepSpeed ZeRO-3 (CPU, gloo, 2 ranks): the frozen
reference (ComputeLogprobs, equal to transformers' own log-probs) and the critic (a value head
trained on returns, ComputeValues, checkpoints that resume exactly). Each refuses what its role
does not serve, before any collective, with the reason."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

from tests.kit.learner import batch
from tests.procs import service

pytestmark = pytest.mark.slow


def role(model: Path, tmp: Path, name: str, *extra: str):
    args = ["learner", "--model", str(model), "--role", name, "--world-size", "2"]
    return service([*args, "--checkpoint-dir", str(tmp), *extra], tmp)


def sequences(seed: int) -> list[lp.TokenSequence]:
    return [
        lp.TokenSequence(prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids)
        for s in batch(seed)
    ]


def refused(call, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    for w in words:
        assert w in e.value.details(), e.value.details()


def test_the_reference_scores_like_transformers_and_is_frozen(tiny_model_dir, tmp_path):
    pytest.importorskip("deepspeed")
    import torch
    from transformers import AutoModelForCausalLM

    with role(tiny_model_dir, tmp_path, "reference") as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        assert stub.GetStatus(lp.GetStatusRequest(), timeout=10).role == "reference"
        seqs = sequences(1)
        got = stub.ComputeLogprobs(lp.ComputeLogprobsRequest(run_id="t", sequences=seqs), timeout=120)
        assert got.policy_version == 0 and len(got.logprobs) == len(seqs)

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        for seq, lps in zip(seqs, got.logprobs, strict=True):
            p, c = list(seq.prompt_token_ids), list(seq.completion_token_ids)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + c])).logits[0]
            want = torch.log_softmax(logits[len(p) - 1 : len(p) + len(c) - 1].float(), -1)
            want = want.gather(-1, torch.tensor(c)[:, None])[:, 0]
            assert list(lps.values) == pytest.approx(want.tolist(), abs=1e-4)

        train = lp.TrainStepRequest(run_id="t", step=1, samples=batch(1))
        refused(lambda: stub.TrainStep(train, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "reference")
        save = lp.SaveCheckpointRequest(path="ref", tag="x")
        refused(lambda: stub.SaveCheckpoint(save, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "frozen")
        values = lp.ComputeValuesRequest(sequences=seqs)
        refused(lambda: stub.ComputeValues(values, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "critic")
        reg = lp.RegisterGeneratorRequest(address="127.0.0.1:1", replica_id="g")
        refused(lambda: stub.RegisterGenerator(reg, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "actor")
        empty = lp.ComputeLogprobsRequest()
        refused(lambda: stub.ComputeLogprobs(empty, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "empty")
        bad = lp.ComputeLogprobsRequest(
            sequences=[lp.TokenSequence(prompt_token_ids=[1], completion_token_ids=[10**6])]
        )
        refused(
            lambda: stub.ComputeLogprobs(bad, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "sequences[0]"
        )
        # refusals changed nothing: the same answer again
        again = stub.ComputeLogprobs(lp.ComputeLogprobsRequest(run_id="t", sequences=seqs), timeout=120)
        assert [list(v.values) for v in again.logprobs] == [list(v.values) for v in got.logprobs]


def _critic_batch(seqs, values) -> list[lp.TrainSample]:
    """Returns 0.8 on every token of even samples, 0.2 on odd ones."""
    return [
        lp.TrainSample(
            prompt_token_ids=s.prompt_token_ids,
            completion_token_ids=s.completion_token_ids,
            returns=[0.8 if i % 2 == 0 else 0.2] * len(s.completion_token_ids),
            values=v,
        )
        for i, (s, v) in enumerate(zip(seqs, values, strict=True))
    ]


def _mse(samples, values) -> float:
    errs = [
        (v - r) ** 2
        for s, vs in zip(samples, values, strict=True)
        for v, r in zip(vs, s.returns, strict=True)
    ]
    return sum(errs) / len(errs)


def test_the_critic_learns_its_returns_and_resumes_exactly(tiny_model_dir, tmp_path):
    pytest.importorskip("deepspeed")
    with role(tiny_model_dir, tmp_path, "critic", "--lr", "3e-4") as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        assert stub.GetStatus(lp.GetStatusRequest(), timeout=10).role == "critic"
        seqs = sequences(2)

        def values() -> list[list[float]]:
            resp = stub.ComputeValues(lp.ComputeValuesRequest(run_id="t", sequences=seqs), timeout=120)
            return [list(v.values) for v in resp.values]

        v = values()
        assert all(x == 0.0 for vs in v for x in vs)  # the value head starts at zero
        first = _mse(_critic_batch(seqs, v), v)
        losses = []
        for step in range(1, 9):
            resp = stub.TrainStep(
                lp.TrainStepRequest(run_id="t", step=step, samples=_critic_batch(seqs, v)), timeout=120
            )
            losses.append(resp.metrics.loss)
            assert resp.step == step and resp.metrics.extra["vf_mse"] >= 0
            v = values()
        # 0.387 -> 0.045 when written (each step lower than the last, at this rate)
        assert _mse(_critic_batch(seqs, v), v) < 0.3 * first, (first, losses)

        saved = stub.SaveCheckpoint(lp.SaveCheckpointRequest(path="run/critic", tag="step8"), timeout=120)
        assert saved.step == 8
        at_save = values()
        stub.TrainStep(lp.TrainStepRequest(run_id="t", step=9, samples=_critic_batch(seqs, v)), timeout=120)
        assert values() != at_save
        loaded = stub.LoadCheckpoint(lp.LoadCheckpointRequest(path="run/critic", tag="step8"), timeout=120)
        assert loaded.step == 8
        assert values() == at_save  # bit for bit: weights restored on every rank

        no_returns = [lp.TrainSample(prompt_token_ids=[1, 2], completion_token_ids=[3], values=[0.0])]
        req = lp.TrainStepRequest(run_id="t", step=9, samples=no_returns)
        refused(
            lambda: stub.TrainStep(req, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "samples[0]", "returns"
        )
        no_values = [lp.TrainSample(prompt_token_ids=[1, 2], completion_token_ids=[3], returns=[1.0])]
        req = lp.TrainStepRequest(run_id="t", step=9, samples=no_values)
        refused(lambda: stub.TrainStep(req, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "values")
        lps = lp.ComputeLogprobsRequest(sequences=seqs)
        refused(lambda: stub.ComputeLogprobs(lps, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "critic")
        export = lp.ExportModelRequest(path="x")
        refused(
            lambda: stub.ExportModel(export, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "checkpoints"
        )
        assert stub.GetStatus(lp.GetStatusRequest(), timeout=10).step == 8  # refusals took no step
