"""The LM head fused with the per-token log-prob and entropy: one autograd node from the hidden
states and the head's weight to two numbers per token, and the choice of head path.

The chunked path (``logprobs.py``) calls the head module per chunk and lets autograd run through
``float()``, ``/ temperature``, ``log_softmax`` and ``gather``, recomputing all of it in backward:
each of those steps writes a ``[chunk, vocab]`` float32 tensor, and ``log_softmax`` saves one for
backward. Here a ``torch.autograd.Function`` takes ``h`` [N, H] and ``W`` [V, H] and, per chunk
of rows:

* forward: ``z = h W^T`` in the compute dtype (bf16 on GPUs), ``x = float(z) / T`` in place (no
  division at T = 1), ``logp = log_softmax(x)[y]``, and only when asked the entropy
  ``-sum(p log p)``. Saved for backward: ``h``, ``W`` (both held by the model anyway) and the
  targets: nothing of the vocabulary's size, however many chunks.
* backward, with the per-token upstream gradient ``g``: ``z`` again (the one matmul that must be
  redone), ``dz = g (onehot(y) - softmax(x)) / T`` in place in float32, cast to the compute dtype,
  then ``dh = dz W`` and ``dW += dz^T h`` (accumulated chunk by chunk into one buffer, as
  autograd sums the chunked path's per-chunk gradients: in the weight's dtype).

Why backward recomputes ``z``: relayrl's losses combine the log-probs per token with advantages,
masks, clipping and sequence ratios (``losses.py``), so ``g`` is known only after the whole
micro-batch's log-probs are. ``dW = sum_i g_i (onehot_i - p_i) h_i^T`` weighs each row by its own
``g_i`` inside the sum over rows: it cannot be formed in forward and rescaled later (what
Liger-Kernel's cross-entropy does for a scalar loss) without keeping ``p`` [N, V]. So each chunk
costs 4 matmuls with a trainable head (3 with a frozen one, 1 without grad), as the chunked path
with recomputation, and far fewer bytes around them.

Which path runs (``head_path``, the one place that decides): fused only where the head is a plain
``torch.nn.Linear`` without bias whose weight is whole on this rank: one rank without DeepSpeed,
ZeRO-1 or ZeRO-2 (weights whole on every rank; gradients reach the weight through autograd's
accumulation as any module's, so ZeRO's gradient hooks see them). Under ZeRO-3 the weight is a
partition that hooks gather when the head *module* is called; reading ``head.weight`` there would
read a shard, so a ZeRO-3 head always runs chunked, keeping its ``calls`` contract (every rank
calls the head as often). So does a head wrapped by PEFT (LoRA on ``lm_head``). ``auto`` picks
fused on CUDA and chunked elsewhere (the CPU reference); ``fused`` also on CPU.
"""

from __future__ import annotations

import torch
from relayrl.learner.config import LmHead
from torch.autograd.function import once_differentiable


def head_path(head: torch.nn.Module, device: torch.device, choice: LmHead = "auto") -> str:
    """``"fused"`` or ``"chunked"`` for ``head`` on ``device`` under ``choice`` (``learner.lm_head``).

    The fused path reads ``head.weight`` directly, so it needs the weight whole and the head a
    bare linear map: a ZeRO-3 partitioned weight (``ds_id``, set by ``deepspeed.zero.Init``) or a
    wrapped head (a LoRA adapter on ``lm_head``, a bias) runs chunked whatever ``choice`` says.

    >>> lin = torch.nn.Linear(4, 8, bias=False)
    >>> head_path(lin, torch.device("cpu")), head_path(lin, torch.device("cuda"))
    ('chunked', 'fused')
    >>> head_path(lin, torch.device("cpu"), "fused"), head_path(lin, torch.device("cuda"), "chunked")
    ('fused', 'chunked')
    >>> lin.weight.ds_id = 7  # a ZeRO-3 parameter
    >>> head_path(lin, torch.device("cuda"), "fused")
    'chunked'
    """
    if choice == "chunked" or not fusable(head):
        return "chunked"
    if choice == "fused" or device.type == "cuda":
        return "fused"
    return "chunked"


def fusable(head: torch.nn.Module) -> bool:
    """Whether ``head(x)`` is exactly ``x @ head.weight.T`` with that weight whole on this rank."""
    return (
        type(head) is torch.nn.Linear
        and head.bias is None
        and not hasattr(head.weight, "ds_id")  # ZeRO-3: a partition, gathered by module hooks only
    )


class FusedHeadLogprobs(torch.autograd.Function):
    """``(h [N, H], W [V, H], y [N]) -> (log softmax(h W^T / T)[y] [N], entropy [N] or [0])``,
    ``rows`` rows at a time; the entropy carries no gradient (a metric)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, rows: int, entropy: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if entropy else 0, dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            # The chunked path's float32 operations, in the same order: the same values.
            lp = torch.log_softmax(_scaled_logits(hidden[lo:hi], weight, temperature), dim=-1)
            logp[lo:hi] = lp.gather(-1, targets[lo:hi, None])[:, 0]
            if entropy:
                ent[lo:hi] = -lp.exp().mul_(lp).sum(-1)
            del lp
        ctx.save_for_backward(hidden, weight, targets)  # nothing the size of the vocabulary
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t, rows, n = ctx.temperature, ctx.rows, hidden.shape[0]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        # d logp_i / d x_i = onehot(y_i) - softmax(x_i), and x = z / T: dz_i = -(g_i / T)(p_i - onehot).
        scale = grad_logp.float() if t == 1.0 else grad_logp.float() / t
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            p = torch.softmax(_scaled_logits(hidden[lo:hi], weight, t), dim=-1)
            # p - onehot in float32 (p_y - 1 cancels when p_y is near 1: not in bf16), then one pass
            # that scales by -g / T and writes the compute dtype the matmuls take.
            p.scatter_add_(-1, targets[lo:hi, None], p.new_full((hi - lo, 1), -1.0))
            dz = p if p.dtype == weight.dtype else torch.empty_like(p, dtype=weight.dtype)
            torch.mul(p, scale[lo:hi, None].neg(), out=dz)
            del p
            if want_h:
                torch.mm(dz, weight, out=grad_h[lo:hi])
            if want_w:
                grad_w.addmm_(dz.t(), hidden[lo:hi])  # summed over chunks in the weight's dtype
            del dz
        return grad_h, grad_w, None, None, None, None


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``h W^T / T``, a tensor this function owns (safe to modify in place): the matmul in
    the compute dtype, as the head module does it; the division skipped at T = 1 (x / 1 is x)."""
    z = h @ weight.t()
    x = z.float() if z.dtype != torch.float32 else z
    return x if temperature == 1.0 else x.div_(temperature)


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    rows_per_chunk: int,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [B, T] under ``hidden`` [B, T, H] @ ``weight``^T / temperature
    (differentiable in ``hidden`` and ``weight``), and the entropies when ``entropy`` (else None),
    ``rows_per_chunk`` rows at a time: the fused twin of ``logprobs.token_logprobs``."""
    b, t, h = hidden.shape
    n = b * t
    if n == 0:
        empty = hidden.new_zeros(b, t, dtype=torch.float32)
        return empty, (empty if entropy else None)
    logp, ent = FusedHeadLogprobs.apply(
        hidden.reshape(n, h), weight, targets.reshape(n), float(temperature), max(1, rows_per_chunk), entropy
    )
    return logp.reshape(b, t), (ent.reshape(b, t) if entropy else None)
