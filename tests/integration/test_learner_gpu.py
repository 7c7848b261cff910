"""The learner on CUDA (marked ``gpu``: skipped without a GPU; ``scripts/gpu_check.sh`` runs them).

A random-init Qwen2 with a 32k vocabulary in bfloat16: train steps over gRPC, save, load, export;
the collectives' device discipline on CUDA ranks; a push over NCCL to a receiver on another GPU;
the fused LM head (the CUDA default) against the chunked reference, in float32 and bfloat16.
"""

from __future__ import annotations

import json

import grpc
import pytest
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

from tests.kit.learner import batch, torchrun
from tests.procs import service

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def cuda_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("cuda-model") / "model"
    cfg = Qwen2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32768, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def test_train_save_load_export_on_cuda(cuda_model, tmp_path):
    import torch
    from safetensors.torch import load_file

    args = ["learner", "--model", str(cuda_model), "--world-size", "1", "--dtype", "bfloat16",
            "--lr", "1e-4", "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    with service(args, tmp_path, timeout=600) as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        steps = [stub.TrainStep(lp.TrainStepRequest(step=i, samples=batch(i)), timeout=600) for i in (1, 2)]
        for r in steps:
            assert torch.isfinite(torch.tensor(r.metrics.loss)) and r.metrics.grad_norm > 0
            assert r.metrics.extra["peak_memory_mb"] > 0  # the CUDA allocator's peak
        stub.SaveCheckpoint(lp.SaveCheckpointRequest(path="ckpt", tag="s2"), timeout=600)
        third = stub.TrainStep(lp.TrainStepRequest(step=3, samples=batch(3)), timeout=600)
        loaded = stub.LoadCheckpoint(lp.LoadCheckpointRequest(path="ckpt", tag="s2"), timeout=600)
        assert (loaded.step, loaded.policy_version) == (2, 2)
        again = stub.TrainStep(lp.TrainStepRequest(step=3, samples=batch(3)), timeout=600)
        assert again.metrics.loss == pytest.approx(third.metrics.loss, rel=1e-2)
        stub.ExportModel(lp.ExportModelRequest(path="export"), timeout=600)
    state = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.isfinite(t.float()).all() for t in state.values())
    assert json.loads((tmp_path / "export" / "relayrl_export.json").read_text())["step"] == 3


def test_collectives_on_cuda_ranks_take_only_device_tensors(cuda_model):
    import torch

    ranks = min(2, torch.cuda.device_count())
    res = torchrun("device_check.py", str(cuda_model), nproc=ranks)
    assert res.stdout.count("every collective tensor had an explicit device") == ranks


def test_push_over_nccl_to_a_receiver_on_another_gpu(cuda_model):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU: needs two GPUs (one GPU: the ipc transport)")
    res = torchrun("device_check.py", str(cuda_model), "nccl", nproc=1)
    assert "every collective tensor had an explicit device" in res.stdout


def test_critic_and_reference_roles_on_cuda(cuda_model, tmp_path):
    """PPO's other learners on CUDA, bfloat16: the reference's log-probs against transformers on
    the same GPU; the critic's values, a step on returns, a checkpoint that restores them."""
    import torch
    from transformers import AutoModelForCausalLM

    seqs = [
        lp.TokenSequence(prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids)
        for s in batch(5)
    ]
    common = [
        "--model",
        str(cuda_model),
        "--world-size",
        "1",
        "--dtype",
        "bfloat16",
        "--checkpoint-dir",
        str(tmp_path),
    ]
    with service(["learner", "--role", "reference", *common], tmp_path, timeout=600) as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        got = stub.ComputeLogprobs(lp.ComputeLogprobsRequest(sequences=seqs), timeout=600).logprobs
    model = AutoModelForCausalLM.from_pretrained(cuda_model, dtype=torch.bfloat16).cuda()
    for seq, lps in zip(seqs, got, strict=True):
        p, c = list(seq.prompt_token_ids), list(seq.completion_token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c], device="cuda")).logits[0].float()
        want = torch.log_softmax(logits[len(p) - 1 : len(p) + len(c) - 1], -1)
        want = want.gather(-1, torch.tensor(c, device="cuda")[:, None])[:, 0].cpu()
        assert list(lps.values) == pytest.approx(want.tolist(), abs=0.1)  # bfloat16 kernels differ
    with service(["learner", "--role", "critic", "--lr", "1e-4", *common], tmp_path, timeout=600) as (
        addr,
        _,
    ):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))

        def values():
            resp = stub.ComputeValues(lp.ComputeValuesRequest(sequences=seqs), timeout=600)
            return [list(v.values) for v in resp.values]

        v0 = values()
        samples = [
            lp.TrainSample(
                prompt_token_ids=s.prompt_token_ids,
                completion_token_ids=s.completion_token_ids,
                returns=[1.0] * len(s.completion_token_ids),
                values=v,
            )
            for s, v in zip(seqs, v0, strict=True)
        ]
        r = stub.TrainStep(lp.TrainStepRequest(step=1, samples=samples), timeout=600)
        assert r.metrics.loss > 0 and r.metrics.extra["peak_memory_mb"] > 0
        stub.SaveCheckpoint(lp.SaveCheckpointRequest(path="critic", tag="s1"), timeout=600)
        v1 = values()
        assert sum(map(sum, v1)) > sum(map(sum, v0))  # toward the returns
        stub.TrainStep(lp.TrainStepRequest(step=2, samples=samples), timeout=600)
        stub.LoadCheckpoint(lp.LoadCheckpointRequest(path="critic", tag="s1"), timeout=600)
        assert values() == v1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_head_equals_chunked_on_cuda(dtype):
    """The unit tests' comparison (tests/unit/test_logprobs.py) on CUDA kernels: the head alone at
    a 32k vocabulary (log-probs, entropies, gradients of hidden states and weight; chunks that
    split 1,200 rows unevenly, one chunk; two temperatures, masked rows), then every loss kind
    through ``Policy`` (loss value and every parameter's gradient). float32: rel < 1e-5, TF32 off.
    bfloat16: no less accurate than the chunked path against a float64 truth (``BF16_SLACK``)."""
    import torch

    from tests.unit.test_logprobs import (
        LOSSES,
        assert_bf16_close,
        loss_batch,
        path_errors,
        policy_run,
        rel,
        tiny_lm,
    )

    dt = getattr(torch, dtype)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the default; float32 must mean float32 here
    try:
        for temperature in (1.0, 0.7):
            for rows in (500, 2000):
                errors = path_errors("cuda", dt, temperature, rows, n=(4, 300), hidden=256, vocab=32768)
                if dt is torch.float32:
                    assert all(e[0] < 1e-5 for e in errors.values()), (temperature, rows, errors)
                else:
                    assert_bf16_close(errors)
        batch = loss_batch(packed=False, device="cuda")
        for kind, cfg in sorted(LOSSES.items()):
            lm, ref = tiny_lm(True, dtype=dt).cuda(), (tiny_lm(True, 3, dt).cuda() if cfg.kl_coef else None)
            chunked = policy_run(lm, batch, cfg, "chunked", 5, ref)
            fused = policy_run(lm, batch, cfg, "fused", 5, ref)
            if dt is torch.float32:
                assert rel(fused[0], chunked[0]) < 1e-5 and rel(fused[2], chunked[2]) < 1e-5, kind
                assert all(rel(fused[3][n], g) < 1e-5 for n, g in chunked[3].items()), kind
                continue
            truth = policy_run(lm.double(), batch, cfg, "chunked", 5, ref.double() if ref else None)
            assert_bf16_close({"loss": (0.0, rel(fused[2], truth[2]), rel(chunked[2], truth[2]))})
            assert_bf16_close(
                {n: (0.0, rel(fused[3][n], g), rel(chunked[3][n], g)) for n, g in truth[3].items()}
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
