"""Attention over packed rows: several sequences in one row, each attending only to itself.

A packed micro-batch is one row of concatenated sequences whose ``position_ids`` restart at 0 at
each sequence, with ``cu_seq_lens`` (cumulative lengths, as flash-attention's varlen API takes
them) passed to the model as keyword arguments; transformers hands them on to the attention
function of every layer. ``ATTENTION`` is that function, registered with transformers' public
``AttentionInterface`` (``register``) and chosen when the model is loaded
(``attn_implementation=ATTENTION``):

* CUDA in bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention's varlen kernel
  shipped with torch; no flash-attn package), one call for the whole row.
* CPU, float32, or a torch without it: one causal SDPA per sequence, which computes exactly the
  attention each sequence gets alone, in O(sum of L^2) rather than a block-diagonal mask's O(T^2).
* Without ``cu_seq_lens`` (padded rows, scoring a single sequence): plain causal SDPA, as the
  ``sdpa`` implementation runs it with no mask.

No mask function is registered for it: transformers then builds no mask at all (a 16k-token
packed row's T^2 mask would be 256M entries) and leaves causality to this function.

Why not the alternatives (measured, ``shared/NOTES.md``, packing): a block-diagonal float mask is
exact but costs the full T^2 (1.5x slower than padding on CPU); position_ids alone under
sdpa/eager with a cache or a mask silently attend across sequences. Models with sliding-window
layers are never packed (``packable``): this function applies no window.
"""

from __future__ import annotations

import inspect

import torch

ATTENTION = "relayrl_varlen"
"""The name the function is registered under (``attn_implementation``)."""

_registered = False


def register() -> None:
    """Register ``ATTENTION`` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    _registered = True


def packable(model_cls, config) -> str:
    """Why a model cannot run packed rows, or "" when it can: its attention must go through
    transformers' attention interface (the function above), and no layer may use a sliding window.

    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> packable(Qwen2ForCausalLM, Qwen2Config())
    ''
    >>> packable(Qwen2ForCausalLM, Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0))
    'its layers use sliding-window attention'
    """
    can = getattr(model_cls, "_can_set_attn_implementation", None)
    if can is None or not can():
        return f"{model_cls.__name__} does not take an attention function through AttentionInterface"
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if any("sliding" in str(t) for t in types) or (window and getattr(config, "use_sliding_window", True)):
        return "its layers use sliding-window attention"
    return ""


def _varlen_cuda():
    """torch's varlen kernel and how this torch asks for causality, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def _repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key and value [B, Hkv, T,
    D] -> ([B, T, H, D], None)."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row; got {query.shape[0]}")
    groups = query.shape[1] // key.shape[1]
    cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    # The varlen kernel is flash-attention's: half precision only (a float32 learner on a GPU
    # takes the per-sample SDPA below).
    half = query.dtype in (torch.float16, torch.bfloat16)
    fn = _varlen_cuda() if query.is_cuda and half else None
    if fn is not None:
        varlen_attn, causal, gqa = fn
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        if not gqa:
            k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
        extra = {"enable_gqa": True} if gqa and groups > 1 else {}
        m = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        out = varlen_attn(q, k, v, cu, cu, m, m, scale=scaling, **causal, **extra)
        return out[None], None  # [1, T, H, D]
    # One causal SDPA per sequence: each attends to exactly its own tokens.
    bounds = cu.tolist()
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi == lo:
            continue
        parts.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, lo:hi],
                key[:, :, lo:hi],
                value[:, :, lo:hi],
                dropout_p=dropout,
                scale=scaling,
                is_causal=True,
                enable_gqa=groups > 1,
            )
        )
    out = torch.cat(parts, dim=2) if parts else query.new_zeros(query.shape)
    return out.transpose(1, 2).contiguous(), None
