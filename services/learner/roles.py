"""The learner's roles, one object each, owning all that differs between them: the model it builds,
its per-token output, its loss and that loss's metric sums, and whether it trains. The trainer
runs any role the same way and never asks which one it runs (prime-rl's rule for its pipeline).

* ``Actor``: the policy, a causal LM trained on advantages (``policy_loss``), optionally as a
  LoRA adapter, with an in-process frozen reference for a KL term (or, with LoRA, the same model
  with its adapter off).
* ``Critic``: the model's backbone and a scalar value head (``models.ValueModel``), trained on
  returns (``value_loss``).
* ``Reference``: the policy frozen: scores only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from relayrl.learner import lora
from relayrl.learner.config import LearnerConfig
from relayrl.learner.losses import LossInputs, Totals, policy_loss, policy_sums, value_loss
from relayrl.learner.models import Policy, ValueModel
from relayrl.learner.samples import Batch


@dataclass
class Built:
    """What a role's model is made of."""

    module: torch.nn.Module
    """The engine's root module (the backbone and the head in one forward)."""
    inner: torch.nn.Module
    """The Hugging Face model inside: its attention, LoRA layers and checkpointing are set on it."""
    pushed: torch.nn.Module
    """The module whose parameter names are pushed and exported (the checkpoint's names)."""


class Role:
    trains = True
    """False: frozen (no optimizer, no TrainStep)."""

    def __init__(self, cfg: LearnerConfig):
        self.cfg = cfg

    def build(self, model_config: Any, dtype: torch.dtype, rows_per_chunk: int) -> Built:
        raise NotImplementedError

    def attach(self, trainer: Any) -> None:
        """Called once the trainer's engine exists (the actor builds its reference here)."""

    def sums(self) -> tuple[str, ...]:
        """Names of the metric sums ``loss`` returns (added up over micro-batches and ranks)."""
        return ()

    def per_token(
        self, engine, b: Batch, calls: int, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's per-token output on a micro-batch, and with ``entropy`` the entropies
        when it has them (a full-vocabulary pass: only for the metric of a training step)."""
        raise NotImplementedError

    def loss(
        self, engine, b: Batch, totals: Totals, calls: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """One micro-batch's share of the step loss, its entropies, and its metric sums (0-dim
        tensors on the device: read once per step)."""
        raise NotImplementedError(f"a {type(self).__name__.lower()} takes no training step")


def _causal_lm(cfg: LearnerConfig, dtype: torch.dtype, rows_per_chunk: int) -> Built:
    from transformers import AutoModelForCausalLM

    inner = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    return Built(Policy(inner, rows_per_chunk, lm_head=cfg.lm_head), inner, inner)


def _logprobs(
    engine, b: Batch, calls: int, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return engine(b.ids, b.targets, b.starts, b.width, temperature, calls, packing=b.packing, entropy=entropy)


class Actor(Role):
    def __init__(self, cfg: LearnerConfig):
        super().__init__(cfg)
        self.ref = None  # the in-process frozen reference's engine (kl_coef > 0, no LoRA)
        self.peft = None  # with LoRA: PEFT's wrapper, whose adapter-off switch gives the reference

    def build(self, model_config: Any, dtype: torch.dtype, rows_per_chunk: int) -> Built:
        return _causal_lm(self.cfg, dtype, rows_per_chunk)

    def attach(self, trainer: Any) -> None:
        self.peft = trainer.peft
        if self.cfg.loss.kl_coef > 0 and self.peft is None:
            self.ref = trainer.frozen_copy(
                lambda: _causal_lm(self.cfg, trainer.dtype, trainer.rows_per_chunk)
            )

    def sums(self) -> tuple[str, ...]:
        return policy_sums(self.cfg.loss)

    def per_token(
        self, engine, b: Batch, calls: int, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _logprobs(engine, b, calls, self.cfg.loss.temperature, entropy)

    def loss(
        self, engine, b: Batch, totals: Totals, calls: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        logp, entropy = self.per_token(engine, b, calls, entropy=True)  # the step's entropy metric
        ref_logp = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp, _ = self.per_token(self.ref, b, calls)
        elif self.peft is not None and self.cfg.loss.kl_coef > 0:
            with torch.no_grad(), lora.disabled(self.peft):
                ref_logp, _ = self.per_token(engine, b, calls)
        loss, stats = policy_loss(
            LossInputs(logp, b.behavior, b.adv, b.mask, ref_logp), self.cfg.loss, totals
        )
        return loss, entropy, stats


class Critic(Role):
    def build(self, model_config: Any, dtype: torch.dtype, rows_per_chunk: int) -> Built:
        from transformers import AutoModel

        # The backbone alone: no LM head, nor its optimizer state.
        backbone = AutoModel.from_pretrained(self.cfg.model, dtype=dtype)
        module = ValueModel(backbone, model_config.hidden_size, dtype)
        return Built(module, backbone, module)

    def sums(self) -> tuple[str, ...]:
        return ("vf_clipped", "vf_sq_err")

    def per_token(
        self, engine, b: Batch, calls: int, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return engine(b.ids, b.starts, b.width, packing=b.packing), None

    def loss(
        self, engine, b: Batch, totals: Totals, calls: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        values, _ = self.per_token(engine, b, calls)
        # With value_clip set every sample carries its old values (decode_samples insists).
        loss, stats = value_loss(
            values, b.old_values, b.returns, b.mask, self.cfg.loss.value_clip, "token", totals
        )
        return loss, None, stats


class Reference(Role):
    trains = False

    def build(self, model_config: Any, dtype: torch.dtype, rows_per_chunk: int) -> Built:
        return _causal_lm(self.cfg, dtype, rows_per_chunk)

    def per_token(
        self, engine, b: Batch, calls: int, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _logprobs(engine, b, calls, self.cfg.loss.temperature, entropy)


ROLES: dict[str, type[Role]] = {"actor": Actor, "critic": Critic, "reference": Reference}


def make_role(cfg: LearnerConfig) -> Role:
    return ROLES[cfg.role](cfg)
