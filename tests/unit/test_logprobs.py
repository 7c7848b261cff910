"""Chunked log-probs (``relayrl.learner.logprobs``) against the full-vocabulary computation they
replace: the same values and gradients in float32 for every loss kind, KL and TIS included, and
never a tensor the size of a micro-batch's logits."""

from __future__ import annotations

import math

import pytest
import torch
from relayrl.learner.config import LossConfig
from relayrl.learner.fused_head import fused_token_logprobs, head_path
from relayrl.learner.logprobs import completion_hidden, head_calls, token_logprobs
from relayrl.learner.losses import LossInputs, Totals, policy_loss
from relayrl.learner.models import Policy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


# -- the fused head (relayrl.learner.fused_head) against the chunked path above ----------------

LOSSES = {
    **CONFIGS,
    "gspo": LossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4),
    "grpo+token": LossConfig(kind="grpo", aggregation="token"),
    "grpo+k2": LossConfig(kind="grpo", kl_coef=0.1, kl_estimator="k2"),
    "grpo+k3+ratio": LossConfig(kind="grpo", kl_coef=0.1, kl_estimator="k3", kl_ratio=True),
    "grpo+tis-mask": LossConfig(kind="grpo", tis_cap=1.5, tis_mode="token_mask"),
    "grpo+tis-seq": LossConfig(kind="grpo", tis_cap=2.0, tis_mode="sequence_truncate"),
    "dapo+tis-seq-mask": LossConfig(kind="dapo", tis_cap=1e3, tis_mode="sequence_mask"),
    "drgrpo+t1.3": LossConfig(kind="drgrpo", temperature=1.3),
}
"""Every loss kind of ``losses.py`` and every option that changes how log-probs enter it."""


def head_case(device, dtype, n=(3, 37), hidden=64, vocab=VOCAB, seed=0):
    """A head weight, hidden states with logits of a realistic spread, targets, and upstream
    gradients zero on masked rows (a right-padded micro-batch, one row masked whole)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    h = torch.randn(*n, hidden, generator=g) * 2.0
    y = torch.randint(0, vocab, n, generator=g)
    mask = torch.ones(n)
    mask[0, 30:], mask[1, 11:], mask[2] = 0.0, 0.0, 0.0
    grad = torch.randn(n, generator=g) * mask
    return (t.to(device) for t in (w.to(dtype), h.to(dtype), y, grad))


def head_outputs(path, w, h, y, grad, temperature, rows, entropy=True, train_w=True):
    """Log-probs, entropies, d(sum grad * logp)/dh and /dW through ``path``: "fused", "chunked",
    or "truth" (the full-vocabulary computation in float64)."""
    if path == "truth":
        w, h = w.double(), h.double()
    w = w.detach().clone().requires_grad_(train_w)
    h = h.detach().clone().requires_grad_(True)
    if path == "fused":
        logp, ent = fused_token_logprobs(h, w, y, temperature, rows, entropy)
    elif path == "chunked":
        head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        head.weight = torch.nn.Parameter(w, requires_grad=train_w)
        w = head.weight
        logp, ent = token_logprobs(head, h, y, temperature, rows, entropy=entropy)
    else:  # the truth: everything in float64 at once, from the same (rounded) inputs
        lp = torch.log_softmax((h @ w.t()) / temperature, dim=-1)
        logp, ent = lp.gather(-1, y[..., None])[..., 0], -(lp.exp() * lp).sum(-1).detach()
    (logp * grad.to(logp.dtype)).sum().backward()
    return {
        "logp": logp.detach().double(),
        "entropy": ent.double() if ent is not None else None,
        "grad_h": h.grad.double(),
        "grad_w": w.grad.double() if train_w else None,
    }


def path_errors(device, dtype, temperature, rows, **shape):
    """Per output (log-probs, entropies, both gradients): relative errors fused vs chunked, fused
    vs a float64 truth and chunked vs that truth, on the same inputs."""
    case = list(head_case(device, dtype, **shape))
    fused, chunked, truth = (head_outputs(p, *case, temperature, rows) for p in ("fused", "chunked", "truth"))
    return {k: (rel(fused[k], chunked[k]), rel(fused[k], truth[k]), rel(chunked[k], truth[k])) for k in truth}


BF16_SLACK = (1.5, 2e-3)
"""bf16: the fused head's error against a float64 truth may be at most 1.5 x the chunked path's
plus 2e-3. Both paths round the same values to bf16 at the same points (the logits out of the
matmul, the logits' gradient into the two matmuls, the weight's gradient summed over chunks), so
each sits a few of bf16's unit roundoffs (2^-9, 2e-3) from the truth; the fused head must be no
less accurate than the reference, whatever the kernels' summation orders."""


def assert_bf16_close(errors):
    for name, (_, fused, chunked) in errors.items():
        assert fused <= BF16_SLACK[0] * chunked + BF16_SLACK[1], (name, fused, chunked)


def test_fused_head_in_bf16_is_as_accurate_as_the_chunked_path():
    for temperature in (1.0, 0.7):
        assert_bf16_close(path_errors("cpu", torch.bfloat16, temperature, 7))


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("rows", [1, 5, 7, 37, 1000])  # one row a chunk, uneven chunks, one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_fused_head_equals_chunked_values_and_gradients(temperature, rows, entropy):
    case = list(head_case("cpu", torch.float32))
    fused = head_outputs("fused", *case, temperature, rows, entropy)
    chunked = head_outputs("chunked", *case, temperature, rows, entropy)
    assert (fused["entropy"] is None) == (chunked["entropy"] is None) == (not entropy)
    for name, want in chunked.items():
        if want is not None:
            assert rel(fused[name], want) < 1e-5, (name, temperature, rows)
    masked = case[3] == 0
    assert not fused["grad_h"][masked].any()  # a masked row gets no gradient


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_same():
    case = list(head_case("cpu", torch.float32))
    fused = head_outputs("fused", *case, 0.7, 7, train_w=False)
    chunked = head_outputs("chunked", *case, 0.7, 7, train_w=False)
    assert fused["grad_w"] is None and rel(fused["grad_h"], chunked["grad_h"]) < 1e-5


def test_fused_head_on_an_empty_batch():
    w, h = torch.randn(VOCAB, 8), torch.zeros(2, 0, 8, requires_grad=True)
    logp, ent = fused_token_logprobs(h, w, torch.zeros(2, 0, dtype=torch.long), 1.0, 4)
    assert logp.shape == ent.shape == (2, 0)
    assert fused_token_logprobs(h, w, torch.zeros(2, 0, dtype=torch.long), 1.0, 4, entropy=False)[1] is None


def policy_run(lm, batch, cfg, head, rows, ref=None, entropy=True):
    """Log-probs, entropies, loss and gradients of one micro-batch through ``Policy(head=...)``."""
    lm.zero_grad(set_to_none=True)
    args = (batch.ids, batch.targets, batch.starts, batch.width, cfg.temperature, None, batch.packing)
    logp, ent = Policy(lm, rows, head)(*args, entropy=entropy)
    ref_logp = None
    if ref is not None:
        with torch.no_grad():
            ref_logp = Policy(ref, rows, head)(*args, entropy=False)[0]
    totals = Totals(tokens=int(batch.mask.sum()), sequences=batch.mask.shape[0], max_tokens=batch.width)
    loss, _ = policy_loss(LossInputs(logp, batch.behavior, batch.adv, batch.mask, ref_logp), cfg, totals)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None}
    return logp.detach() * batch.mask, ent, loss.detach(), grads


def loss_batch(packed: bool, device="cpu"):
    """Six samples of uneven lengths, one with an environment span masked out of the loss."""
    from relayrl.learner.samples import Sample, to_batch

    g = torch.Generator().manual_seed(2)
    lengths = [(5, 7), (3, 9), (8, 4), (6, 6), (2, 11), (9, 1)]
    samples = []
    for i, (p, c) in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (p + c,), generator=g).tolist()
        behavior = (-torch.rand(c, generator=g) * 6 - 0.5).tolist()
        mask = [0.0 if i == 1 and 3 <= j < 6 else 1.0 for j in range(c)]
        samples.append(Sample(ids[:p], ids[p:], behavior, (-1.0) ** i * (0.5 + i / 4), mask))
    return to_batch(samples, torch.device(device), packed=packed)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_fused_equals_chunked_for_every_loss_kind(kind, tied):
    """The loss value and every parameter's gradient (the head, the embeddings it may share its
    weight with, the backbone below it) through ``Policy``: fused and chunked agree in float32."""
    cfg = LOSSES[kind]
    batch = loss_batch(packed=False)
    ref = tiny_lm(tied, seed=3) if cfg.kl_coef else None
    lm = tiny_lm(tied)
    for rows in (5, 1000):
        chunked = policy_run(lm, batch, cfg, "chunked", rows, ref)
        fused = policy_run(lm, batch, cfg, "fused", rows, ref)
        assert rel(fused[0], chunked[0]) < 1e-5 and rel(fused[1], chunked[1]) < 1e-5, (kind, rows)
        assert float(fused[2]) == pytest.approx(float(chunked[2]), rel=1e-5, abs=1e-9), (kind, rows)
        assert set(fused[3]) == set(chunked[3])
        for name, g in chunked[3].items():
            assert rel(fused[3][name], g) < 1e-5, (kind, rows, name)


@pytest.mark.parametrize("kind", ["grpo", "gspo", "grpo+k3"])
def test_fused_equals_chunked_packed(kind):
    """Packed micro-batches: the head runs on completion rows only, entropies scattered or None."""
    from relayrl.learner.attention import ATTENTION, register

    register()
    cfg = LOSSES[kind]
    lm = tiny_lm(True)
    lm.set_attn_implementation(ATTENTION)
    ref = tiny_lm(True, seed=3) if cfg.kl_coef else None
    if ref is not None:
        ref.set_attn_implementation(ATTENTION)
    batch = loss_batch(packed=True)
    chunked = policy_run(lm, batch, cfg, "chunked", 7, ref)
    fused = policy_run(lm, batch, cfg, "fused", 7, ref, entropy=False)
    assert fused[1] is None and chunked[1].shape == batch.mask.shape
    assert rel(fused[0], chunked[0]) < 1e-5
    assert float(fused[2]) == pytest.approx(float(chunked[2]), rel=1e-5)
    for name, g in chunked[3].items():
        assert rel(fused[3][name], g) < 1e-5, (kind, name)


class _HeadCalls:
    def __init__(self, module):
        self.calls = 0
        module.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def test_the_path_policy_takes_and_zero3_keeps_its_head_calls():
    """Fused never calls the head module (it reads the weight); a ZeRO-3 weight (a partition,
    gathered by the module's hooks) always goes through the module, ``calls`` times."""
    ids, _, targets, _, starts, width, _, _ = a_batch()
    lm = tiny_lm(tied=False)
    seen = _HeadCalls(lm.lm_head)
    Policy(lm, 5, "fused")(ids, targets, starts, width, 1.0, calls=9)
    assert seen.calls == 0
    Policy(lm, 5)(ids, targets, starts, width, 1.0, calls=9)  # auto on CPU: chunked
    assert seen.calls == 9
    lm.lm_head.weight.ds_id = 0  # what deepspeed.zero.Init marks a partitioned parameter with
    logp, _ = Policy(lm, 5, "fused")(ids, targets, starts, width, 1.0, calls=9)
    assert seen.calls == 18
    logp.sum().backward()
    assert seen.calls == 27  # recomputed in backward, as often on every rank
    assert head_path(lm.lm_head, torch.device("cuda")) == "chunked"
    del lm.lm_head.weight.ds_id
    assert head_path(lm.lm_head, torch.device("cuda")) == "fused"
    assert head_path(torch.nn.Linear(4, 8), torch.device("cuda"), "fused") == "chunked"  # a bias


@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_no_entropy_no_full_vocabulary_exponential_and_no_division_at_t1(path):
    w, h, y, _ = head_case("cpu", torch.float32)
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    head.weight = torch.nn.Parameter(w)
    h.requires_grad_(True)
    for entropy, temperature, exps, divs in ((True, 1.0, 3, 0), (False, 1.0, 0, 0), (False, 0.5, 0, 3)):
        with _Wide(VOCAB) as ops:  # forward only, 3 x 37 rows: 3 chunks
            if path == "fused":
                fused_token_logprobs(h, head.weight, y, temperature, 37, entropy)
            else:
                token_logprobs(head, h, y, temperature, 37, entropy=entropy)
        assert (ops.count(torch.ops.aten.exp), ops.count(torch.ops.aten.div)) == (exps, divs), (
            path, entropy, temperature,
        )  # fmt: skip


class _Wide(TorchDispatchMode):
    """The operations that produce a full-vocabulary tensor ([rows, vocab]), by name."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.ops = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == self.vocab:
            self.ops.append(func.overloadpacket)
        return out

    def count(self, packet) -> int:  # in place or not: div and div_ alike
        return sum(op.__name__.rstrip("_") == packet.__name__ for op in self.ops)


class _Cost(TorchDispatchMode):
    """What predicts the head's GPU time: matmuls (compute) and the bytes read and written of
    ``[chunk, vocab]`` tensors by everything else (memory traffic; gathers and in-place scatters
    touch one element a row and count nothing; allocations without a fill count nothing)."""

    NO_READ = {torch.ops.aten.empty_like, torch.ops.aten.new_full, torch.ops.aten.new_zeros}
    INDEX = {torch.ops.aten.gather, torch.ops.aten.scatter_add_, torch.ops.aten.detach}
    MATMUL = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}

    def __init__(self, wide: int):
        super().__init__()
        self.wide, self.matmuls, self.bytes = wide, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.overloadpacket
        self.matmuls += op in self.MATMUL
        if func.is_view or op in self.INDEX:
            return out

        def wide(t):
            return isinstance(t, torch.Tensor) and t.numel() == self.wide

        inputs = (args, {k: v for k, v in kwargs.items() if k != "out"})
        reads = [] if op in self.NO_READ else [t for t in tree_leaves(inputs) if wide(t)]
        writes = (
            {} if op is torch.ops.aten.empty_like else {t.data_ptr(): t for t in tree_leaves(out) if wide(t)}
        )
        self.bytes += sum(t.numel() * t.element_size() for t in (*reads, *writes.values()))
        return out


def head_cost(path, dtype, temperature, entropy, rows, train_w=True, grad=True, n=64, hidden=48):
    """Forward and backward of one head (``n`` rows, ``rows`` a chunk): matmuls, bytes moved per
    logit, and the tensors saved for backward (the weight aside: the model holds it anyway)."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, VOCAB, bias=False).to(dtype).requires_grad_(train_w)
    h = torch.randn(1, n, hidden, generator=g).to(dtype).requires_grad_(grad)
    y = torch.randint(0, VOCAB, (1, n), generator=g)
    saved = []

    def pack(t):
        if t.data_ptr() != head.weight.data_ptr():
            saved.append((tuple(t.shape), t.dtype))
        return t

    with _Cost(min(rows, n) * VOCAB) as cost, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if path == "fused":
            logp, _ = fused_token_logprobs(h, head.weight, y, temperature, rows, entropy)
        else:
            logp, _ = token_logprobs(head, h, y, temperature, rows, entropy=entropy)
        forward = cost.matmuls
        if grad:
            logp.sum().backward()
    return {"forward": forward, "matmuls": cost.matmuls, "bytes": cost.bytes / (n * VOCAB), "saved": saved}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_head_saves_nothing_vocabulary_wide_and_moves_fewer_bytes(dtype):
    """Counted on CPU, what a GPU pays for: no [rows, vocab] tensor saved for backward, however
    many chunks; the same matmuls as the chunked path when it recomputes (4 a chunk: 1 forward,
    the recompute, dh, dW; 3 with a frozen head; 1 without grad), one more when the micro-batch
    is one chunk (where the chunked path keeps a float32 [rows, vocab] instead); fewer bytes."""
    n, chunks = 64, 4
    for temperature in (1.0, 0.7):
        for entropy in (True, False):
            fused = head_cost("fused", dtype, temperature, entropy, n // chunks)
            chunked = head_cost("chunked", dtype, temperature, entropy, n // chunks)
            assert not [s for s in fused["saved"] if VOCAB in s[0]], fused["saved"]
            assert (fused["forward"], fused["matmuls"]) == (chunks, 4 * chunks)
            assert (chunked["forward"], chunked["matmuls"]) == (chunks, 4 * chunks)
            # Measured, bytes per logit, fused vs chunked (bf16; fp32): T=1 with entropy 66 vs 90
            # (64 vs 80), without 42 vs 66 (40 vs 56); T=0.7 with entropy 82 vs 114 (80 vs 104),
            # without 58 vs 90 (56 vs 80).
            assert fused["bytes"] <= 0.8 * chunked["bytes"], (temperature, entropy, fused, chunked)
    one_fused = head_cost("fused", dtype, 0.7, True, n)
    one_chunked = head_cost("chunked", dtype, 0.7, True, n)
    assert ((n, VOCAB), torch.float32) in one_chunked["saved"]  # what the fused path never keeps
    assert not [s for s in one_fused["saved"] if VOCAB in s[0]]
    assert (one_fused["matmuls"], one_chunked["matmuls"]) == (4, 3)
    assert head_cost("fused", dtype, 0.7, True, n // chunks, train_w=False)["matmuls"] == 3 * chunks
    assert head_cost("fused", dtype, 0.7, True, n // chunks, grad=False, train_w=False)["matmuls"] == chunks
    # Before the fused head, the chunked path always divided and always took the entropy: 114 B a
    # logit in bf16 at any temperature, against the fused head's 42 at T = 1 without entropy.
    least, most = head_cost("fused", dtype, 1.0, False, 16), head_cost("chunked", dtype, 0.7, True, 16)
    assert least["bytes"] < 0.4 * most["bytes"]
