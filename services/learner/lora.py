"""The actor as a LoRA adapter over frozen base weights (``learner.lora``, PEFT).

What changes with an adapter, and where:
* ``wrap``: PEFT's LoRA layers injected into the Hugging Face model in place (same module tree,
  so ``Policy`` runs it unchanged); only the adapter's tensors train, and the optimizer holds
  state for them alone. Their initial values are drawn from a fixed seed, the same on every
  rank and in a plain PEFT run of the same model.
* ``adapter_params``: the trained tensors under PEFT's saved names
  (``base_model.model.<module>.lora_A.weight``): what a push sends, what ``adapter_model.safetensors``
  holds, what a replica's vLLM loads (``common/weightsync/adapters.py``).
* ``disabled``: the base model's log-probs for a KL term, the adapter switched off: the reference
  without a second copy of the model.
* ``merged``: base weights with each update folded in (W + alpha/r B A) under the base model's
  own names: an export any tool loads as a plain model.
Checkpoints hold the adapter and its optimizer state only (the base is read from the model
folder again).
"""

from __future__ import annotations

import contextlib
import re

import torch
from relayrl.common.weightsync.adapters import AdapterSpec
from relayrl.learner.config import LoraConfig

INIT_SEED = 0
"""Seed of the adapter's initial lora_A (lora_B starts at zero: the adapter starts as a no-op)."""
_ADAPTER = "default"
_TRAINED = re.compile(r"(.+)\.lora_([AB])\.default\.weight")


def peft_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLora

    return PeftLora(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=list(cfg.target_modules),
        lora_dropout=cfg.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, cfg: LoraConfig):
    """Inject LoRA layers into ``model`` (in place); returns PEFT's wrapper (for ``disabled``)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):  # the same start on every rank, without moving their RNG
        torch.manual_seed(INIT_SEED)
        peft_model = get_peft_model(model, peft_config(cfg))
    return peft_model


def spec(cfg: LoraConfig) -> AdapterSpec:
    return AdapterSpec(cfg.rank, cfg.alpha, tuple(cfg.target_modules))


def saved_name(param_name: str) -> str | None:
    """PEFT's saved name of one of the HF model's parameters, or None for a base weight.

    >>> saved_name("model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    >>> saved_name("model.layers.0.self_attn.q_proj.base_layer.weight") is None
    True
    """
    got = _TRAINED.fullmatch(param_name)
    return f"base_model.model.{got.group(1)}.lora_{got.group(2)}.weight" if got else None


def base_name(param_name: str) -> str:
    """A base weight's name in the model folder (PEFT moves it under ``base_layer``).

    >>> base_name("model.layers.0.mlp.up_proj.base_layer.weight"), base_name("lm_head.weight")
    ('model.layers.0.mlp.up_proj.weight', 'lm_head.weight')
    """
    return param_name.replace(".base_layer.", ".")


def adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters by saved name (the order of ``named_parameters``)."""
    out = {}
    for name, p in model.named_parameters():
        if (saved := saved_name(name)) is not None:
            out[saved] = p
    return out


def base_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every other parameter by its name in the model folder."""
    return {base_name(n): p for n, p in model.named_parameters() if saved_name(n) is None}


@contextlib.contextmanager
def disabled(peft_model):
    """The base model: every LoRA layer off inside (PEFT's own switch)."""
    with peft_model.disable_adapter():
        yield


def merged(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], s: AdapterSpec) -> dict:
    """Base weights (folder names) with each adapter update folded in, in float32 then back to
    the weight's dtype: W + (alpha / r) B @ A.

    >>> W = {"m.q_proj.weight": torch.zeros(2, 3)}
    >>> A = {"base_model.model.m.q_proj.lora_A.weight": torch.ones(1, 3),
    ...      "base_model.model.m.q_proj.lora_B.weight": torch.full((2, 1), 2.0)}
    >>> merged(W, A, AdapterSpec(1, 2.0, ("q_proj",)))["m.q_proj.weight"].tolist()
    [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
    """
    out = dict(base)
    scale = s.alpha / s.rank
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len("base_model.model.") : -len(".lora_A.weight")]
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out
