"""The modules a learner trains or runs, one per role, each DeepSpeed's root module (so the
backbone and the head run inside one forward and ZeRO-3's hooks see every module call).

* ``Policy`` (actor, reference): a Hugging Face causal LM answering per-token log-probs and
  (when asked) entropies of completion tokens, never from full-vocabulary logits: through the
  fused head (``fused_head.py``) where the head's weight is whole, else chunked (``logprobs.py``:
  ``calls`` LM-head calls, the same on every rank, as ZeRO-3 needs); ``fused_head.head_path``
  decides.
* ``ValueModel`` (critic): the same model's backbone (no LM head: for Qwen2.5-0.5B that is 136M
  parameters, and their optimizer state, not held) and a scalar value head, answering the value
  of the state before each completion token, PPO's V(s_t) (verl's critic reads the same
  positions: the hidden state that predicts token t).
"""

from __future__ import annotations

import torch
from relayrl.learner.config import LmHead
from relayrl.learner.fused_head import fused_token_logprobs, head_path
from relayrl.learner.logprobs import completion_hidden, token_logprobs
from relayrl.learner.packing import Packing


class Policy(torch.nn.Module):
    """``lm`` keeps the HF model, whose parameter names are the checkpoint's; ``lm_head``: the
    config's choice of head path (``learner.lm_head``; ``fused_head.head_path`` applies it)."""

    def __init__(self, lm: torch.nn.Module, rows_per_chunk: int, lm_head: LmHead = "auto"):
        super().__init__()
        self.lm = lm
        self.rows_per_chunk = rows_per_chunk
        self.head_choice = lm_head

    def _token_logprobs(self, hidden, targets, temperature, calls, entropy):
        """Per-token log-probs (and entropies, or None) of ``targets`` [B, T] from ``hidden``
        [B, T, H], by the path ``head_path`` picks for this head on this device."""
        head = self.lm.get_output_embeddings()
        if head_path(head, hidden.device, self.head_choice) == "fused":  # no collective: ``calls`` is moot
            return fused_token_logprobs(
                hidden, head.weight, targets, temperature, self.rows_per_chunk, entropy
            )
        return token_logprobs(head, hidden, targets, temperature, self.rows_per_chunk, calls, entropy)

    def forward(
        self,
        ids,
        targets,
        starts: list[int],
        width: int,
        temperature: float,
        calls: int | None = None,
        packing: Packing | None = None,
        entropy: bool = True,
    ):
        """(log-probs, entropies) [B, width]; entropies None unless ``entropy`` (a
        full-vocabulary pass: only for a loss or a metric that reads them)."""
        if packing is not None:  # one row of whole samples: the head runs on completion rows only
            hidden = self.lm.base_model(input_ids=ids, **packing.model_kwargs()).last_hidden_state
            rows = hidden[0, packing.pred][None]
            targets = targets[packing.rows, packing.cols][None]
            logp, ent = self._token_logprobs(rows, targets, temperature, calls, entropy)
            return packing.scatter(logp, width), (packing.scatter(ent, width) if entropy else None)
        # No attention mask: rows are right-padded and attention is causal, so no real token
        # attends to a pad (pads only come after it) and the pads' own outputs are masked out of
        # every loss. Without a mask, attention takes its causal fast path (SDPA, flash).
        hidden = self.lm.base_model(input_ids=ids, use_cache=False).last_hidden_state
        return self._token_logprobs(
            completion_hidden(hidden, starts, width), targets, temperature, calls, entropy
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

    def forward(self, ids, starts: list[int], width: int, packing: Packing | None = None):
        if packing is not None:
            hidden = self.backbone(input_ids=ids, **packing.model_kwargs()).last_hidden_state
            values = self.value_head(hidden[0, packing.pred]).squeeze(-1).float()
            return packing.scatter(values, width)
        hidden = self.backbone(input_ids=ids, use_cache=False).last_hidden_state
        return self.value_head(completion_hidden(hidden, starts, width)).squeeze(-1).float()
