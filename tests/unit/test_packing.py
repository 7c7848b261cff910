"""Packed micro-batches (``learner/packing.py``, ``learner/attention.py``) against padded ones:
the same log-probs, losses and gradients for every loss kind (KL and TIS included) in float32,
for a Qwen2 and a Llama model and for the critic's values; no sample sees another (changing one
leaves the others' log-probs bit-identical); the plan keeps ranks in step and the budget."""

from __future__ import annotations

import random

import pytest
import torch
from relayrl.learner.attention import ATTENTION, packable, register
from relayrl.learner.batching import plan_step
from relayrl.learner.losses import LossInputs, Totals, policy_loss
from relayrl.learner.models import Policy, ValueModel
from relayrl.learner.samples import Sample, to_batch

from tests.unit.test_logprobs import CONFIGS, VOCAB, rel

CPU = torch.device("cpu")
LENGTHS = [(5, 7), (3, 9), (8, 4), (6, 6), (2, 11), (9, 1)]  # (prompt, completion)


def lm(family: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))


def samples(seed: int = 1, lengths=tuple(LENGTHS)) -> list[Sample]:
    g = random.Random(seed)
    return [
        Sample(
            [g.randrange(3, VOCAB) for _ in range(p)],
            [g.randrange(3, VOCAB) for _ in range(c)],
            [-g.uniform(0.5, 6.0) for _ in range(c)],
            g.choice((-1.0, 1.0)) * g.uniform(0.5, 1.5),
            [],
        )
        for p, c in lengths
    ]


def packed(model):
    register()
    model.set_attn_implementation(ATTENTION)
    return model


def run(model, batch, cfg, ref=None, rows_per_chunk=7):
    """Log-probs, loss and gradients of one micro-batch through ``Policy``."""
    model.zero_grad(set_to_none=True)
    policy = Policy(model, rows_per_chunk)
    logp, entropy = policy(
        batch.ids, batch.targets, batch.starts, batch.width, cfg.temperature, None, batch.packing
    )
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = Policy(ref, rows_per_chunk)(
                batch.ids, batch.targets, batch.starts, batch.width, cfg.temperature, None, batch.packing
            )[0]
    totals = Totals(tokens=int(batch.mask.sum()), sequences=batch.mask.shape[0], max_tokens=batch.width)
    loss, _ = policy_loss(LossInputs(logp, batch.behavior, batch.adv, batch.mask, ref_logp), cfg, totals)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach() * batch.mask, (entropy * batch.mask), loss.detach(), grads


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_packed_equals_padded_for_every_loss(kind, family):
    cfg = CONFIGS[kind]
    batch = samples()
    ref = lm(family, seed=3) if cfg.kl_coef else None
    padded = run(lm(family), to_batch(batch, CPU), cfg, ref)
    ref = packed(ref) if ref is not None else None
    got = run(packed(lm(family)), to_batch(batch, CPU, packed=True), cfg, ref)
    assert rel(got[0], padded[0]) < 1e-5 and rel(got[1], padded[1]) < 1e-5, kind
    assert float(got[2]) == pytest.approx(float(padded[2]), rel=1e-5, abs=1e-9), kind
    assert set(got[3]) == set(padded[3])
    for name, g in padded[3].items():
        assert rel(got[3][name], g) < 1e-5, (kind, name)


def test_no_sample_sees_another():
    model = packed(lm("qwen2"))
    cfg = CONFIGS["grpo"]
    batch = samples()
    changed = [
        Sample(list(s.prompt), list(s.completion), s.behavior_logprobs, s.advantage, []) for s in batch
    ]
    changed[2].prompt = [t + 1 for t in changed[2].prompt]  # another prompt, same lengths
    changed[2].completion = list(reversed(changed[2].completion))
    a = run(model, to_batch(batch, CPU, packed=True), cfg)[0]
    b = run(model, to_batch(changed, CPU, packed=True), cfg)[0]
    others = [i for i in range(len(batch)) if i != 2]
    assert torch.equal(a[others], b[others])  # bit-identical
    assert not torch.equal(a[2], b[2])
    # And a sample packed beside others equals the sample alone.
    alone = run(model, to_batch(batch[1:2], CPU, packed=True), cfg)[0]
    assert rel(a[1:2, : alone.shape[1]], alone) < 1e-6


def test_the_critics_values_packed_equal_padded():
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    backbone = Qwen2Model(Qwen2Config(**shape))
    critic = ValueModel(backbone, 64, torch.float32)
    torch.nn.init.normal_(critic.value_head.weight)
    batch = samples()
    a = to_batch(batch, CPU)
    want = critic(a.ids, a.starts, a.width) * a.mask
    packed(backbone)
    b = to_batch(batch, CPU, packed=True)
    assert rel((critic(b.ids, b.starts, b.width, b.packing) * b.mask).detach(), want.detach()) < 1e-5


def test_models_that_cannot_run_packed_rows_are_named():
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    assert packable(Qwen2ForCausalLM, Qwen2Config()) == ""
    assert "sliding" in packable(MistralForCausalLM, MistralConfig(sliding_window=4096))
    assert packable(MistralForCausalLM, MistralConfig(sliding_window=None)) == ""

    class Custom(torch.nn.Module):  # attention of its own, not through AttentionInterface
        pass

    assert "AttentionInterface" in packable(Custom, Qwen2Config())


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_packed_plans_keep_every_rank_in_step_within_the_budget(world_size):
    g = random.Random(world_size)
    lengths = [g.choice((20, 40, 80, 300, 1024)) for _ in range(64)]
    plans = plan_step(lengths, world_size, 2048, packed=True)
    assert len({len(p) for p in plans}) == 1  # as many micro-batches on every rank
    seen = sorted(i for p in plans for mb in p for i in mb)
    assert seen == list(range(64))
    for p in plans:
        for mb in p:
            assert sum(lengths[i] for i in mb) <= 2048 or len(mb) == 1
    # Packing fills micro-batches: no more of them than the padded plan, usually far fewer.
    padded = plan_step(lengths, world_size, 2048)
    assert len(plans[0]) <= len(padded[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_rows_on_cuda_take_the_varlen_kernel_and_equal_padded(dtype):
    """On CUDA, bf16 takes torch's varlen kernel (flash-attention's) and float32 the per-sample
    SDPA: either way the same log-probs and gradients as padded SDPA, to the dtype's precision."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from relayrl.learner import attention

    assert attention._varlen_cuda() is not None, "this torch has no varlen_attn"
    cuda = torch.device("cuda")
    cfg = CONFIGS["grpo"]
    batch = samples(lengths=[(30, 60), (12, 40), (50, 70), (5, 17)])
    padded_model, packed_model = lm("qwen2").to(cuda, dtype), packed(lm("qwen2")).to(cuda, dtype)
    a = run(padded_model, to_batch(batch, cuda), cfg)
    b = run(packed_model, to_batch(batch, cuda, packed=True), cfg)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel(b[0].float(), a[0].float()) < tol
    for name, g in a[3].items():
        assert rel(b[3][name].float(), g.float()) < 10 * tol, name
