"""Chunked log-probs (``relayrl.learner.logprobs``) against the full-vocabulary computation they
replace: the same values and gradients in float32 for every loss kind, KL and TIS included, and
never a tensor the size of a micro-batch's logits."""

from __future__ import annotations

import math

import pytest
import torch
from relayrl.learner.config import LossConfig
from relayrl.learner.logprobs import completion_hidden, head_calls, token_logprobs
from relayrl.learner.losses import LossInputs, Totals, policy_loss
from relayrl.learner.models import Policy
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 512


def test_hand_softmax_at_every_chunk_size():
    # Token 0: logits ln1, ln2, ln3 -> p = 1/6, 2/6, 3/6. Token 1: logits 0, 0, 0 -> uniform.
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)], [0.0, 0.0, 0.0]]], requires_grad=True)
    targets = torch.tensor([[2, 0]])
    h0 = -sum(p * math.log(p) for p in (1 / 6, 2 / 6, 3 / 6))
    for rows in (1, 2, 100):  # the head is the identity: hidden states are the logits
        picked, entropy = token_logprobs(torch.nn.Identity(), logits, targets, 1.0, rows)
        assert picked.tolist()[0] == pytest.approx([math.log(1 / 2), math.log(1 / 3)], rel=1e-6)
        assert entropy.tolist()[0] == pytest.approx([h0, math.log(3)], rel=1e-6)
        assert picked.requires_grad and not entropy.requires_grad
    # Temperature 2: logits / 2 = ln(sqrt k) -> p proportional to 1, sqrt2, sqrt3.
    picked, entropy = token_logprobs(torch.nn.Identity(), logits, targets, 2.0, 1)
    z = 1 + math.sqrt(2) + math.sqrt(3)
    probs = [1 / z, math.sqrt(2) / z, math.sqrt(3) / z]
    assert picked.tolist()[0] == pytest.approx([math.log(math.sqrt(3) / z), math.log(1 / 3)], rel=1e-6)
    assert entropy.tolist()[0] == pytest.approx([-sum(p * math.log(p) for p in probs), math.log(3)], rel=1e-6)


class CountingHead(torch.nn.Identity):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


@pytest.mark.parametrize("calls", [1, 2, 3, 5, 9])
def test_a_set_number_of_head_calls_gives_the_same_values_and_gradients(calls):
    """Ranks call the LM head as often as the rank that needs most (ZeRO-3 gathers its weight at
    each call): fewer rows than calls leaves trailing chunks empty, and nothing else changes,
    forward or backward (where each chunk is recomputed: the head is called again, as often)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 2, 7, generator=g)  # 4 rows: 9 calls leave 5 empty
    targets = torch.randint(0, 7, (2, 2), generator=g)
    ref = logits.clone().requires_grad_(True)
    want = torch.log_softmax(ref, -1).gather(-1, targets[..., None])[..., 0]
    want.sum().backward()
    x = logits.clone().requires_grad_(True)
    head = CountingHead()
    picked, _ = token_logprobs(head, x, targets, 1.0, rows_per_chunk=1, calls=calls)
    assert head.calls == calls
    picked.sum().backward()
    assert head.calls == (2 * calls if calls > 1 else 1)  # recomputed in backward, chunk by chunk
    assert picked.flatten().tolist() == pytest.approx(want.flatten().tolist(), abs=1e-6)
    assert x.grad.flatten().tolist() == pytest.approx(ref.grad.flatten().tolist(), abs=1e-6)
    assert head_calls(4, 1) == 4 and head_calls(4, 3) == 2


def tiny_lm(tied: bool, seed: int = 0, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).to(dtype)


def a_batch(seed: int = 1, rows=((5, 7), (3, 9), (8, 4), (6, 6))):
    """Rows of the given (prompt, completion) lengths, right-padded as the trainer pads them."""
    g = torch.Generator().manual_seed(seed)
    total, width = max(p + c for p, c in rows), max(c for _, c in rows)
    ids = torch.zeros(len(rows), total, dtype=torch.long)
    attn = torch.zeros_like(ids)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, (p, c) in enumerate(rows):
        seq = torch.randint(3, VOCAB, (p + c,), generator=g)
        ids[i, : p + c], attn[i, : p + c] = seq, 1
        targets[i, :c], mask[i, :c] = seq[p:], 1.0
    starts = [p for p, _ in rows]
    behavior = -torch.rand(len(rows), width, generator=g) * 6 - 0.5
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5] * (len(rows) // 4 + 1))[: len(rows)]
    return ids, attn, targets, mask, starts, width, behavior, adv


def full_logprobs(lm, ids, attn, targets, starts, width, temperature):
    """What the learner computed before: full logits, gathered, soft-maxed in float32."""
    logits = lm(input_ids=ids, attention_mask=attn).logits
    sel = completion_hidden(logits, starts, width)  # the same position arithmetic, on logits
    logp = torch.log_softmax(sel.to(torch.promote_types(sel.dtype, torch.float32)) / temperature, dim=-1)
    picked = logp.gather(-1, targets[..., None])[..., 0]
    return picked, -(logp.exp() * logp).sum(-1).detach()


CONFIGS = {
    "grpo": LossConfig(kind="grpo"),
    "drgrpo": LossConfig(kind="drgrpo"),
    "dapo": LossConfig(kind="dapo", clip_high=0.28),
    "sft": LossConfig(kind="sft"),
    "grpo+k3": LossConfig(kind="grpo", kl_coef=0.1, kl_estimator="k3"),
    "dapo+k1": LossConfig(kind="dapo", kl_coef=0.05, kl_estimator="k1"),
    "grpo+tis": LossConfig(kind="grpo", tis_cap=2.0),
    "grpo+t0.7": LossConfig(kind="grpo", temperature=0.7),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# (log-probs and entropies, loss and gradients): relative, on whole tensors. float32 sums taken in
# another order (per chunk) differ in the last bits; float64 shows the algebra is the same.
TOLERANCE = {torch.float32: (1e-6, 5e-6), torch.float64: (1e-12, 1e-12)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_chunked_equals_full_logits_values_and_gradients(kind, tied, dtype):
    cfg = CONFIGS[kind]
    values_tol, grads_tol = TOLERANCE[dtype]
    ids, attn, targets, mask, starts, width, behavior, adv = a_batch()
    behavior, adv = behavior.to(dtype), adv.to(dtype)
    totals = Totals(tokens=int(mask.sum()), sequences=4, max_tokens=width)
    ref_lm = tiny_lm(tied, seed=3, dtype=dtype)  # the frozen reference of the KL term

    def run(lm, compute):
        lm.zero_grad(set_to_none=True)
        logp, entropy = compute(lm)
        with torch.no_grad():
            ref = compute(ref_lm)[0] if cfg.kl_coef else None
        loss, _ = policy_loss(LossInputs(logp, behavior, adv, mask, ref), cfg, totals)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters()}
        return logp.detach(), entropy, loss.detach(), grads

    lm = tiny_lm(tied, dtype=dtype)
    full = run(lm, lambda m: full_logprobs(m, ids, attn, targets, starts, width, cfg.temperature))
    for rows in (1, 7, 1000):  # one token per chunk, uneven chunks, one chunk
        chunked = run(lm, lambda m, r=rows: Policy(m, r)(ids, targets, starts, width, cfg.temperature))
        assert rel(chunked[0], full[0]) < values_tol and rel(chunked[1], full[1]) < values_tol, (kind, rows)
        assert float(chunked[2]) == pytest.approx(float(full[2]), rel=grads_tol, abs=1e-12), (kind, rows)
        for name, g in full[3].items():
            assert rel(chunked[3][name], g) < grads_tol, (kind, rows, name)


class _Shapes(TorchDispatchMode):
    """Records the largest tensor any operation produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_a_micro_batchs_logits_is_ever_made():
    ids, attn, targets, mask, starts, width, behavior, adv = a_batch(rows=[(4, 16)] * 8)
    lm = tiny_lm(tied=True)
    rows = 5
    with _Shapes() as seen:
        logp, _ = Policy(lm, rows)(ids, targets, starts, width, 1.0)
        loss, _ = policy_loss(
            LossInputs(logp, behavior, adv, mask), CONFIGS["grpo"], Totals(int(mask.sum()), 8)
        )
        loss.backward()
    chunk = rows * VOCAB
    biggest_weight = max(p.numel() for p in lm.parameters())
    assert seen.largest <= max(chunk, biggest_weight), seen.largest
    assert seen.largest < ids.shape[0] * width * VOCAB  # what the full logits of the completions took


class _Exps(TorchDispatchMode):
    """Counts the exponentials taken (the entropy's ``logp.exp()``; log_softmax uses none)."""

    def __init__(self):
        super().__init__()
        self.exps = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.exps += func is torch.ops.aten.exp.default
        return func(*args, **(kwargs or {}))


def test_backward_recomputes_the_logits_but_not_the_entropy():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 7, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (2, 6), generator=g)
    head = CountingHead()
    with _Exps() as count:
        picked, entropy = token_logprobs(head, hidden, targets, 1.0, rows_per_chunk=4, calls=3)
        forward_exps = count.exps
        picked.sum().backward()
    assert head.calls == 6  # 3 chunks, each recomputed once in backward
    assert forward_exps == 3 and count.exps == 3  # the entropy: once per chunk, in forward only
    want = -(torch.log_softmax(hidden.detach(), -1).exp() * torch.log_softmax(hidden.detach(), -1)).sum(-1)
    assert torch.allclose(entropy, want, atol=1e-6)
