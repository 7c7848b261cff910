"""The micro-batch token budget a learner derives from its model and its device's free memory
(``learner.micro_batch_tokens`` unset).

A fixed budget is sized for the worst case: 8,192 tokens at 1.5B left an H200 at 51 GB of 141.
Activation memory per token is known from the model's shapes (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", without the attention-score term that flash
and SDPA kernels never store): per layer, about 9 hidden-size and 4 MLP-width tensors of the
compute dtype, and the two float32 norm inputs; with activation checkpointing, one layer's worth
plus each layer's input. Measured on an H200 (bench/learner.py, 2026-11-28) relayrl held 1.5 MB
per token at 0.5B and 3.3 MB at 1.5B; the estimate below gives 1.5 and 3.1 before its margin.

On CUDA the budget is what fits in the memory free once the model is loaded, less what the first
step still allocates (optimizer moments, float32 gradients), times ``FRACTION``; every rank takes
the smallest (ZeRO-3 needs the same micro-batch count on every rank). On CPU the host's memory is
shared with the other services of an embedded run, so the budget stays ``CPU_TOKENS``.
"""

from __future__ import annotations

from typing import Any

CPU_TOKENS = 4096
MIN_TOKENS, MAX_TOKENS, MULTIPLE = 256, 1 << 17, 256
FRACTION = 0.8
"""Of the memory left for activations, the share a budget plans to fill."""
MARGIN = 1.25
"""On top of the estimate: allocator fragmentation, the LM head's chunk, temporaries."""
STEP_BYTES_PER_PARAM = 14
"""Allocated at the first step, per trainable parameter: Adam's two float32 moments (8), the
float32 gradients (4), a bfloat16 gradient in flight (2)."""


def activation_bytes_per_token(model_config: Any, dtype_bytes: int, checkpointing: bool) -> int:
    """Bytes of activations one token keeps for backward, across all layers (see the module doc).

    >>> from types import SimpleNamespace as C
    >>> qwen05 = C(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    >>> round(activation_bytes_per_token(qwen05, 2, False) / 1e6, 2)
    1.49
    >>> activation_bytes_per_token(qwen05, 2, True) < activation_bytes_per_token(qwen05, 2, False) / 10
    True
    """
    h, inter, layers = (
        model_config.hidden_size,
        model_config.intermediate_size,
        model_config.num_hidden_layers,
    )
    layer = (9 * h + 4 * inter) * dtype_bytes + 2 * 4 * h  # the two norms keep float32 inputs
    if checkpointing:
        return layers * h * dtype_bytes + layer
    return layers * layer


def micro_batch_tokens(model_config: Any, dtype_bytes: int, free_bytes: int, checkpointing: bool) -> int:
    """Tokens per micro-batch that fit ``free_bytes`` of activations (a multiple of 256, within
    [256, 131072]).

    >>> from types import SimpleNamespace as C
    >>> qwen15 = C(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
    >>> micro_batch_tokens(qwen15, 2, 100 << 30, False)  # an H200 with a 1.5B model loaded
    21760
    >>> micro_batch_tokens(qwen15, 2, 1 << 20, False)
    256
    """
    per_token = activation_bytes_per_token(model_config, dtype_bytes, checkpointing) * MARGIN
    tokens = int(FRACTION * max(0, free_bytes) / per_token) // MULTIPLE * MULTIPLE
    return max(MIN_TOKENS, min(MAX_TOKENS, tokens))
