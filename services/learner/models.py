"""The modules a learner trains or runs, one per role, each DeepSpeed's root module (so the
backbone and the head run inside one forward and ZeRO-3's hooks see every module call).

* ``Policy`` (actor, reference): a Hugging Face causal LM answering per-token log-probs and
  entropies of completion tokens (``logprobs.py``: chunked, no full-vocabulary logits; ``calls``
  LM-head calls, the same on every rank).
* ``ValueModel`` (critic): the same model's backbone (no LM head: for Qwen2.5-0.5B that is 136M
  parameters, and their optimizer state, not held) and a scalar value head, answering the value
  of the state before each completion token, PPO's V(s_t) (verl's critic reads the same
  positions: the hidden state that predicts token t).
"""

from __future__ import annotations

import torch
from relayrl.learner.logprobs import completion_hidden, token_logprobs


class Policy(torch.nn.Module):
    """``lm`` keeps the HF model, whose parameter names are the checkpoint's."""

    def __init__(self, lm: torch.nn.Module, rows_per_chunk: int):
        super().__init__()
        self.lm = lm
        self.rows_per_chunk = rows_per_chunk

    def forward(
        self, ids, targets, starts: list[int], width: int, temperature: float, calls: int | None = None
    ):
        # No attention mask: rows are right-padded and attention is causal, so no real token
        # attends to a pad (pads only come after it) and the pads' own outputs are masked out of
        # every loss. Without a mask, attention takes its causal fast path (SDPA, flash).
        hidden = self.lm.base_model(input_ids=ids).last_hidden_state
        return token_logprobs(
            self.lm.get_output_embeddings(),
            completion_hidden(hidden, starts, width),
            targets,
            temperature,
            self.rows_per_chunk,
            calls,
        )


class ValueModel(torch.nn.Module):
    """A backbone (``AutoModel``: the causal LM without its head) and ``value_head``, a linear
    map of the last hidden state to one float. The head starts at zero, so the first values are 0
    on every rank alike and GAE starts as Monte-Carlo returns; the backbone starts from the
    policy's weights, as verl and OpenRLHF initialise their critics."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, ids, starts: list[int], width: int):
        hidden = self.backbone(input_ids=ids).last_hidden_state
        return self.value_head(completion_hidden(hidden, starts, width)).squeeze(-1).float()
