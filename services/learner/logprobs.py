"""Per-token log-probs and entropy of completion tokens, without full-vocabulary logits.

A causal LM's logits for a micro-batch are ``[batch, tokens, vocab]``: with Qwen2.5's 151,936
entries and float32 for the softmax, 64 x 512 tokens are 20 GB, most of a learner's memory. Only
two numbers per token are needed (the target's log-prob, and the entropy as a metric). So the
final hidden states ``[batch, tokens, hidden]`` are taken at the positions that predict
completion tokens, flattened, and cut into chunks of rows; each chunk goes through the LM head,
is reduced to those two numbers, and its logits are dropped. In backward each chunk's logits are
recomputed from its hidden states (activation checkpointing), so at most one chunk of logits
exists at a time, forward or backward. TRL, verl and Liger do the same for the same reason. When
a micro-batch fits in one chunk nothing is recomputed (there is no memory to save).

Values equal the full computation's: ``log_softmax`` is ``x - logsumexp(x)`` either way, in
float32 (tests/unit/test_logprobs.py compares them, gradients included).

In flow the backbone's last hidden states, the LM head module (called per chunk, so ZeRO-3's
hooks gather its weight as for any module call) and the targets; out flow ``[batch, tokens]``
log-probs (differentiable) and, when asked, entropies (no gradient; a full-vocabulary pass per
chunk, so only a loss or a metric that reads them should ask).

This is the reference, the CPU path and the ZeRO-3 path; ``fused_head.py`` is the fused one
(``fused_head.head_path`` chooses).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def completion_hidden(hidden: torch.Tensor, starts: list[int], width: int) -> torch.Tensor:
    """The hidden states that predict completion tokens: row ``i``'s token ``j`` sits at position
    ``starts[i] + j`` and is predicted from position ``starts[i] + j - 1``. ``[B, width, H]``;
    positions past a row's end repeat its last one (they are masked out of every loss)."""
    b, s, h = hidden.shape
    idx = (
        torch.as_tensor(starts, device=hidden.device)[:, None]
        + torch.arange(width, device=hidden.device)[None, :]
        - 1
    )
    idx = idx.clamp(min=0, max=s - 1)
    return hidden.gather(1, idx[:, :, None].expand(b, width, h))


def _chunk(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: list | None,
) -> torch.Tensor:
    """The chunk's target log-probs; its entropies go into ``entropy`` (None: not asked) the first
    time only: when backward recomputes the chunk (activation checkpointing calls this again with
    the same arguments) they would be computed over the whole vocabulary once more and thrown
    away."""
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:  # x / 1 is x: a full-vocabulary pass for nothing
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    if entropy is not None and not entropy:
        with torch.no_grad():
            entropy.append(-(logp.exp() * logp).sum(-1))
    return picked


def chunk_rows(vocab_size: int, chunk_mib: float) -> int:
    """Rows per chunk so that one chunk's float32 logits take about ``chunk_mib`` MiB.

    >>> chunk_rows(151936, 512), chunk_rows(512, 512)
    (883, 262144)
    """
    return max(1, int(chunk_mib * (1 << 20)) // (4 * vocab_size))


def head_calls(n_rows: int, rows_per_chunk: int) -> int:
    """Chunks (LM-head calls) for ``n_rows`` rows of at most ``rows_per_chunk`` each.

    >>> head_calls(0, 883), head_calls(883, 883), head_calls(884, 883)
    (1, 1, 2)
    """
    return max(1, -(-n_rows // rows_per_chunk))


def token_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    rows_per_chunk: int,
    calls: int | None = None,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [B, T] under ``head(hidden)`` / temperature (hidden [B, T, H]),
    and per-token entropies when ``entropy`` (else None), computed ``rows_per_chunk`` tokens at a
    time.

    ``calls``: call the head exactly this many times (chunks of equal size, trailing ones empty
    when there are fewer rows), forward and, when recomputing, backward. Under ZeRO-3 every head
    call gathers the head's weight with a collective, so every rank must make as many calls as
    the others even when their micro-batches differ in size: the trainer passes the most any
    rank needs (``head_calls``)."""
    b, t, h = hidden.shape
    n = b * t
    flat_h, flat_t = hidden.reshape(n, h), targets.reshape(n)
    if calls is None:
        if n == 0:  # an empty batch
            empty = hidden.new_zeros(b, t, dtype=torch.float32)
            return empty, (empty if entropy else None)
        calls = head_calls(n, rows_per_chunk)
    size = max(1, -(-n // calls))
    # Recomputing in backward bounds memory to one chunk; with one chunk there is nothing to
    # bound, and the recomputation would only cost time. Decided by ``calls`` alone, which every
    # rank shares: a rank recomputing while another does not would also call the head unevenly.
    recompute = torch.is_grad_enabled() and hidden.requires_grad and calls > 1
    picked, entropies = [], []
    for c in range(calls):
        lo, hi = min(c * size, n), min((c + 1) * size, n)
        ent: list[torch.Tensor] | None = [] if entropy else None
        args = (head, flat_h[lo:hi], flat_t[lo:hi], temperature, ent)
        # Recompute the chunk's logits in backward instead of keeping them: that is the point.
        picked.append(checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args))
        if ent is not None:
            entropies.append(ent[0])
    logp = torch.cat(picked).reshape(b, t)
    return logp, (torch.cat(entropies).reshape(b, t) if entropy else None)
