"""The learner service on real DeepSpeed ZeRO-3 (CPU, gloo, 2 ranks) with a real generator."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest
from relayrl.common.v1 import common_pb2
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg

from tests.kit.learner import batch, torchrun
from tests.procs import service

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def learner(model: Path, tmp: Path, *extra: str):
    """Two ZeRO-3 ranks whose checkpoint and export paths must lie in ``tmp``."""
    args = [
        "learner",
        "--model",
        str(model),
        "--world-size",
        "2",
        "--lr",
        "1e-3",
        "--checkpoint-dir",
        str(tmp),
    ]
    return service([*args, *extra], tmp)


def train(stub, step: int, seed: int) -> lp.TrainStepResponse:
    return stub.TrainStep(lp.TrainStepRequest(run_id="t", step=step, samples=batch(seed)), timeout=300)


@pytest.fixture(scope="module")
def zero3_checks(tiny_model_dir) -> str:
    """The output of zero3_check.py's two ranks: both checks in one torchrun launch."""
    return torchrun("zero3_check.py", str(tiny_model_dir)).stdout


def test_parameters_are_partitioned_over_two_ranks(zero3_checks):
    assert zero3_checks.count("params partitioned") == 2, zero3_checks[-3000:]


def test_a_step_with_a_non_finite_gradient_norm_changes_nothing_on_any_rank(zero3_checks):
    assert zero3_checks.count("non-finite step skipped, state unchanged") == 2, zero3_checks[-3000:]


def test_every_collective_tensor_has_an_explicit_device(tiny_model_dir):
    """The CPU stand-in for "NCCL takes no CPU tensor": train, push, save, load and export with
    collectives that refuse a tensor relayrl made without naming its device (device_check.py)."""
    res = torchrun("device_check.py", str(tiny_model_dir))
    assert res.stdout.count("every collective tensor had an explicit device") == 2


def test_ranks_call_the_lm_head_alike_when_their_micro_batches_differ(tiny_model_dir, tmp_path):
    """ZeRO-3 gathers the LM head's weight at every call, a collective over the ranks. With a
    real vocabulary a micro-batch's logits take several chunks, as many as its rows need; ranks
    whose shares differ in size then called the head unevenly and waited on each other's gathers
    until the deadline (found in review, before any GPU run; this test timed out then). Chunks of
    5 rows here (a 512-entry vocabulary at 0.01 MiB) do what Qwen's 151,936 entries do at the
    default 512 MiB: train steps, with the recomputation in backward, and ComputeLogprobs must
    finish and agree with the same run in one chunk."""
    small = ("--set", "logits_chunk_mib=0.01")
    results = {}
    for name, extra in (("chunked", small), ("whole", ())):
        (tmp_path / name).mkdir()
        with learner(tiny_model_dir, tmp_path / name, *extra) as (addr, _):
            stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
            seqs = [
                lp.TokenSequence(
                    prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids
                )
                for s in batch(7)
            ]
            before = stub.ComputeLogprobs(lp.ComputeLogprobsRequest(sequences=seqs), timeout=120)
            steps = [
                stub.TrainStep(lp.TrainStepRequest(step=i, samples=batch(i)), timeout=120) for i in (1, 2)
            ]
            after = stub.ComputeLogprobs(lp.ComputeLogprobsRequest(sequences=seqs), timeout=120)
            results[name] = (
                [x for v in before.logprobs for x in v.values],
                [s.metrics.loss for s in steps],
                [x for v in after.logprobs for x in v.values],
            )
    (b1, l1, a1), (b2, l2, a2) = results["chunked"], results["whole"]
    assert b1 == pytest.approx(b2, abs=1e-5)
    assert l1 == pytest.approx(l2, rel=1e-4)
    assert a1 == pytest.approx(a2, abs=1e-4)  # the same training, chunk size aside
    assert a1 != pytest.approx(b1, abs=1e-4)  # and it did train


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("learner")
    gen_args = [
        "generator",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--replica-id",
        "gen-0",
    ]
    with service(gen_args, tmp) as (gen_addr, _), learner(tiny_model_dir, tmp) as (addr, proc):
        yield (
            lg.LearnerServiceStub(grpc.insecure_channel(addr)),
            gg.GeneratorServiceStub(grpc.insecure_channel(gen_addr)),
            gen_addr,
            tmp,
            proc,
            tiny_model_dir,
        )


def test_bad_batches_are_refused_and_take_no_step(stack):
    stub, *_ = stack
    before = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    nan = lp.TrainSample(
        prompt_token_ids=[5], completion_token_ids=[6], generator_logprobs=[-1.0], advantage=float("nan")
    )
    short = lp.TrainSample(prompt_token_ids=[5], completion_token_ids=[6, 7], generator_logprobs=[-1.0])

    def one(**kw):
        fields = dict(prompt_token_ids=[5], completion_token_ids=[6, 7], generator_logprobs=[-1.0, -2.0])
        return lp.TrainSample(**{**fields, **kw})

    cases = {
        "samples is empty": [],
        "samples[0]: advantage is nan": [nan],
        "samples[0]: 1 generator_logprobs for 2 completion tokens": [short],
        "samples[1]: token ids must be in": [
            batch(1)[0],
            lp.TrainSample(prompt_token_ids=[10**6], completion_token_ids=[6], generator_logprobs=[-1.0]),
        ],
        # every value that once disabled the learner or answered INTERNAL after the step was applied
        "samples[0]: loss_mask values must be in [0, 1]": [one(loss_mask=[1.0, float("nan")])],
        "samples[1]: loss_mask values must be in [0, 1]": [one(), one(loss_mask=[float("inf"), 1.0])],
        "samples[2]: loss_mask values must be in [0, 1]": [one(), one(), one(loss_mask=[-1.0, 1.0])],
        "samples[0]: loss_mask values must be in [0, 1] ": [one(loss_mask=[1e30, 1.0])],
        "samples[0]: advantage is 1e+30; |advantage| must be <= 1e+06": [one(advantage=1e30)],
        "samples[0]: generator_logprobs[1] is 0.5": [one(generator_logprobs=[-1.0, 0.5])],
        "samples[0]: generator_logprobs[0] is -1e+30": [one(generator_logprobs=[-1e30, -1.0])],
    }
    for needle, samples in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            stub.TrainStep(lp.TrainStepRequest(step=before.step + 1, samples=samples), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle.strip() in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.TrainStep(lp.TrainStepRequest(step=before.step + 5, samples=batch(0)), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    after = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    assert (after.step, after.policy_version, after.ready) == (before.step, before.policy_version, True)


def test_train_push_and_generator_matches_learner(stack):
    import torch
    from transformers import AutoModelForCausalLM

    stub, gen, gen_addr, tmp_path, *_ = stack
    r1 = train(stub, 1, seed=1)
    r2 = train(stub, 2, seed=2)
    assert (r2.step, r2.policy_version) == (2, 2)
    for r in (r1, r2):
        m = r.metrics
        assert m.samples == 6 and m.tokens > 0 and m.grad_norm > 0 and m.lr == pytest.approx(1e-3)
        assert 0 <= m.clip_fraction <= 1 and m.entropy > 0 and m.step_seconds > 0
        # Made-up generator log-probs: a gap, and single-turn samples have no env span to follow.
        assert m.extra["logprob_abs_diff"] > 0 and "logprob_abs_diff_after_env" not in m.extra
    assert train(stub, 2, seed=2) == r2  # a retried step is answered, not trained twice
    reg = stub.RegisterGenerator(
        lp.RegisterGeneratorRequest(address=gen_addr, replica_id="gen-0"), timeout=60
    )
    # Same host, CPU: the weights go through shared memory (one copy, no sockets).
    assert list(reg.replica_ids) == ["gen-0"] and reg.transport == "shm"
    assert gen.GetStatus(g.GetStatusRequest(), timeout=10).weight_transport == g.WEIGHT_TRANSPORT_SHM
    with pytest.raises(grpc.RpcError) as e:
        stub.PushWeights(lp.PushWeightsRequest(version=1), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    push = stub.PushWeights(lp.PushWeightsRequest(version=2, bucket_bytes=200_000), timeout=300)
    assert (
        list(push.replica_ids) == ["gen-0"] and push.bytes > 0
    )  # checksums compared inside: DATA_LOSS otherwise
    assert gen.GetStatus(g.GetStatusRequest(), timeout=10).policy_version == 2
    again = stub.PushWeights(lp.PushWeightsRequest(version=2), timeout=60)  # idempotent: replica is current
    assert again.bytes == 0
    st = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    assert [(x.replica_id, x.policy_version) for x in st.generators] == [("gen-0", 2)]

    out = tmp_path / "export"
    exp = stub.ExportModel(lp.ExportModelRequest(path=str(out)), timeout=300)
    assert exp.policy_version == 2 and json.loads((out / "relayrl_export.json").read_text())["step"] == 2
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompts = [[1, 20 + i, 30, 40, 50] for i in range(3)]
    req = g.GenerateRequest(
        prompts=[
            common_pb2.Prompt(prompt_id=f"p{i}", token_ids=common_pb2.TokenIds(ids=p))
            for i, p in enumerate(prompts)
        ],
        sampling=g.SamplingParams(n=1, temperature=0.0, max_tokens=24, ignore_eos=True),
    )
    got = {
        s.prompt_id: list(s.completion_token_ids) for r in gen.Generate(req, timeout=60) for s in r.samples
    }
    for i, p in enumerate(prompts):
        ref = hf.generate(
            torch.tensor([p]),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        assert got[f"p{i}"] == ref, f"prompt {i}: generator diverges from the learner's exported weights"
    base = AutoModelForCausalLM.from_pretrained(stack[5], dtype=torch.float32)
    changed = [n for n, p in hf.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert len(changed) == len(list(base.parameters())), "every parameter moved in two steps"


def test_multi_turn_episodes_train_with_the_generators_logprobs(stack):
    """Episodes the generator sampled at the learner's weights (float32 both), environment tokens
    spliced between turns as the coordinator bridges them (loss_mask 0, generator log-prob 0.0):
    the step's learner-generator gap is numerical noise, right after the bridges too."""
    stub, gen, gen_addr, *_ = stack
    st = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    if not st.generators:
        stub.RegisterGenerator(lp.RegisterGeneratorRequest(address=gen_addr, replica_id="gen-0"), timeout=60)
    if gen.GetStatus(g.GetStatusRequest(), timeout=10).policy_version != st.policy_version:
        stub.PushWeights(lp.PushWeightsRequest(version=st.policy_version), timeout=300)

    def sample(prompts: dict[str, list[int]], n: int):
        req = g.GenerateRequest(
            prompts=[
                common_pb2.Prompt(prompt_id=k, token_ids=common_pb2.TokenIds(ids=v))
                for k, v in prompts.items()
            ],
            sampling=g.SamplingParams(n=1, temperature=1.0, max_tokens=n, ignore_eos=True, seed=5),
        )
        return {s.prompt_id: s for r in gen.Generate(req, timeout=120) for s in r.samples}

    env = [7, 8, 9]  # a tool answer, rendered
    prompts = {f"p{i}": [1, 20 + i, 30, 40, 50] for i in range(3)}
    first = sample(prompts, 6)
    ctx = {k: p + list(first[k].completion_token_ids) + env for k, p in prompts.items()}
    second = sample(ctx, 12)  # longer than the 8-token window after the bridge
    samples = []
    for i, (k, p) in enumerate(prompts.items()):
        a, b = first[k], second[k]
        samples.append(
            lp.TrainSample(
                prompt_token_ids=p,
                completion_token_ids=[*a.completion_token_ids, *env, *b.completion_token_ids],
                generator_logprobs=[*a.logprobs, *[0.0] * len(env), *b.logprobs],
                loss_mask=[1.0] * len(a.logprobs) + [0.0] * len(env) + [1.0] * len(b.logprobs),
                advantage=1.0 if i % 2 else -1.0,
                policy_version=st.policy_version,
            )
        )
    r = stub.TrainStep(lp.TrainStepRequest(run_id="t", step=st.step + 1, samples=samples), timeout=300)
    extra = r.metrics.extra
    assert r.metrics.tokens == 3 * (6 + 12)
    assert 0 <= extra["logprob_abs_diff"] < 1e-3, extra
    assert 0 <= extra["logprob_abs_diff_after_env"] < 1e-3, extra
    assert "after_env_weight" not in extra


def test_unreachable_generator_is_refused_at_registration_and_training_goes_on(stack):
    stub, *_ = stack
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterGenerator(
            lp.RegisterGeneratorRequest(address="127.0.0.1:1", replica_id="ghost"), timeout=60
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "ghost" in e.value.details()
    step = stub.GetStatus(lp.GetStatusRequest(), timeout=10).step
    r = train(stub, step + 1, seed=3)
    push = stub.PushWeights(lp.PushWeightsRequest(version=r.policy_version), timeout=300)
    assert list(push.replica_ids) == ["gen-0"]
    st = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    assert st.ready and [(x.replica_id, x.transport) for x in st.generators] == [("gen-0", "shm")]


def test_checkpoint_paths_and_tags_stay_inside_and_refusals_change_nothing(stack):
    """Hostile tags and paths: refused with the field named, nothing written outside
    ``checkpoint_dir``, the learner still ready and training afterwards."""
    stub, _, _, tmp, *_ = stack
    before = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    (tmp / "a-file").write_text("x")
    outside = tmp.parent / f"{tmp.name}-outside"

    def refused(call, req, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=120)
        assert e.value.code() == code, (req, e.value.details())
        assert len(e.value.details()) < 1100
        return e.value.details()

    for tag in ["../../x", "sub/../../../x", "/abs", "t" * 1000, "nul\0byte", "..", "."]:
        assert "letters, digits" in refused(stub.SaveCheckpoint, lp.SaveCheckpointRequest(tag=tag))
        assert "letters, digits" in refused(stub.LoadCheckpoint, lp.LoadCheckpointRequest(tag=tag))
    for path in [str(outside), "/tmp/elsewhere", "sub/../../x", "../x"]:
        for call, req in [
            (stub.SaveCheckpoint, lp.SaveCheckpointRequest(path=path, tag="t")),
            (stub.LoadCheckpoint, lp.LoadCheckpointRequest(path=path, tag="t")),
            (stub.ExportModel, lp.ExportModelRequest(path=path)),
        ]:
            assert "outside" in (d := refused(call, req)) or "'..'" in d
    assert "is not a folder" in refused(
        stub.SaveCheckpoint, lp.SaveCheckpointRequest(path="a-file/x", tag="t")
    )
    assert "is not a folder" in refused(stub.ExportModel, lp.ExportModelRequest(path="a-file/x"))
    bad_state = lp.SaveCheckpointRequest(tag="t", client_state_json="{not json")
    assert "client_state_json is not JSON" in refused(stub.SaveCheckpoint, bad_state)
    # Nothing to load: NOT_FOUND, as the contract says, whatever is missing.
    (tmp / "empty" / "t0").mkdir(parents=True)
    (tmp / "badlatest").mkdir()
    (tmp / "badlatest" / "latest").write_text("../../etc")
    not_found = grpc.StatusCode.NOT_FOUND
    refused(stub.LoadCheckpoint, lp.LoadCheckpointRequest(path="nowhere"), not_found)
    refused(stub.LoadCheckpoint, lp.LoadCheckpointRequest(path="empty", tag="missing"), not_found)
    assert "finds no" in refused(
        stub.LoadCheckpoint, lp.LoadCheckpointRequest(path="empty", tag="t0"), not_found
    )
    refused(stub.LoadCheckpoint, lp.LoadCheckpointRequest(path="badlatest"), not_found)
    assert not outside.exists() and not (tmp.parent / "x").exists()
    after = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    assert (after.step, after.policy_version, after.ready) == (before.step, before.policy_version, True)
    r = train(stub, after.step + 1, seed=21)
    assert r.step == after.step + 1


def test_a_step_whose_deadline_passes_runs_once_and_its_retry_gets_its_answer(stack):
    stub, *_ = stack
    step = stub.GetStatus(lp.GetStatusRequest(), timeout=10).step
    big = lp.TrainStepRequest(run_id="t", step=step + 1, samples=batch(31, n=64))
    # The caller gives up mid-step: the step still completes (the other rank is in it) ...
    with pytest.raises(grpc.RpcError) as e:
        stub.TrainStep(big, timeout=0.05)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # ... and the retry of that step gets that step's response, not the previous one's.
    again = stub.TrainStep(big, timeout=300)
    assert (again.step, again.policy_version) == (step + 1, step + 1)
    assert stub.TrainStep(big, timeout=300) == again
    with pytest.raises(grpc.RpcError) as e:  # the same step number with another batch
        stub.TrainStep(lp.TrainStepRequest(run_id="t", step=step + 1, samples=batch(32)), timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different batch" in e.value.details()
    # A step whose deadline passes while it waits for the one before it is not taken at all.
    first = stub.TrainStep.future(
        lp.TrainStepRequest(run_id="t", step=step + 2, samples=batch(33, n=64)), timeout=300
    )
    time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as e:
        stub.TrainStep(lp.TrainStepRequest(run_id="t", step=step + 3, samples=batch(34)), timeout=0.05)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert first.result().step == step + 2
    time.sleep(0.5)  # let the refused one reach the lock and be refused there
    st = stub.GetStatus(lp.GetStatusRequest(), timeout=10)
    assert (st.step, st.ready) == (step + 2, True)


def test_resume_continues_identically(tiny_model_dir, tmp_path):
    """4 steps straight == 2 steps, checkpoint, new learner process, load, 2 steps (bitwise)."""
    from safetensors.torch import load_file

    ckpt, straight, resumed = tmp_path / "ckpt", tmp_path / "straight", tmp_path / "resumed"
    with learner(tiny_model_dir, tmp_path) as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        train(stub, 1, seed=11)
        train(stub, 2, seed=12)
        saved = stub.SaveCheckpoint(
            lp.SaveCheckpointRequest(path=str(ckpt), tag="s2", client_state_json='{"pos": 7}'), timeout=300
        )
        assert (saved.step, saved.tag) == (2, "s2")
        train(stub, 3, seed=13)
        train(stub, 4, seed=14)
        stub.ExportModel(lp.ExportModelRequest(path=str(straight)), timeout=300)
    with learner(tiny_model_dir, tmp_path) as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadCheckpoint(
                lp.LoadCheckpointRequest(path=str(tmp_path / "nothing"), tag="s2"), timeout=60
            )
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        loaded = stub.LoadCheckpoint(lp.LoadCheckpointRequest(path=str(ckpt), tag="s2"), timeout=300)
        assert (loaded.step, loaded.policy_version, json.loads(loaded.client_state_json)) == (
            2,
            2,
            {"pos": 7},
        )
        train(stub, 3, seed=13)
        train(stub, 4, seed=14)
        stub.ExportModel(lp.ExportModelRequest(path=str(resumed)), timeout=300)
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() == 0, k


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_a_forced_transport_works_or_is_refused_at_registration_with_its_reason(stack, transport, tmp_path):
    """Forced gloo reaches the generator (greedy output then equals transformers on the learner's
    weights); forced ipc on a CPU learner is refused when the replica registers, at once."""
    import torch
    from transformers import AutoModelForCausalLM

    _, gen, gen_addr, _, _, model = stack
    with learner(model, tmp_path, "--set", f"weight_sync_transport={transport}") as (addr, _):
        stub = lg.LearnerServiceStub(grpc.insecure_channel(addr))
        req = lp.RegisterGeneratorRequest(address=gen_addr, replica_id="gen-0")
        if transport == "ipc":
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterGenerator(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "ipc: RuntimeError: the learner trains on the CPU" in e.value.details()
            assert not stub.GetStatus(lp.GetStatusRequest(), timeout=10).generators
            return
        assert stub.RegisterGenerator(req, timeout=60).transport == "gloo"
        version = gen.GetStatus(g.GetStatusRequest(), timeout=10).policy_version
        for step in range(1, version + 2):  # past the generator's version: it takes only newer ones
            train(stub, step, seed=40 + step)
        push = stub.PushWeights(lp.PushWeightsRequest(version=version + 1), timeout=300)
        assert list(push.replica_ids) == ["gen-0"] and push.bytes > 0
        assert gen.GetStatus(g.GetStatusRequest(), timeout=10).weight_transport == g.WEIGHT_TRANSPORT_GLOO
        stub.ExportModel(lp.ExportModelRequest(path="export"), timeout=300)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    prompt = [1, 20, 30, 40, 50]
    got = next(
        s
        for r in gen.Generate(
            g.GenerateRequest(
                prompts=[common_pb2.Prompt(prompt_id="p", token_ids=common_pb2.TokenIds(ids=prompt))],
                sampling=g.SamplingParams(n=1, temperature=0.0, max_tokens=16, ignore_eos=True),
            ),
            timeout=60,
        )
        for s in r.samples
    )
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert list(got.completion_token_ids) == ref
