"""Policy losses of the GRPO family, as pure functions of per-token tensors.

Inputs are per-token tensors of shape [B, T] over completion tokens (``mask`` is 1 where a token
counts) and per-sequence advantages [B]. The functions return a *partial sum*: the micro-batch's
share of the global loss, already divided by the global normaliser (tokens or sequences of the
whole step, over all ranks and micro-batches). Summing the returned values over micro-batches
and ranks therefore gives exactly the loss of the full batch, whatever the split.

Ratios. ``behavior_logprobs`` are the generator's logprobs (the policy that sampled, possibly a
few versions old). Without TIS the PPO ratio is ``pi_theta / pi_behavior``: clipping bounds the
update against the policy that actually sampled (off-policy correct under staleness). With TIS
(``tis_cap``) the ratio is taken against the learner's own current policy (``pi_theta /
sg(pi_theta)``, value 1, so clipping is inactive on a single step) and each token's loss is
weighted by ``min(sg(pi_theta) / pi_behavior, tis_cap)``: truncated importance sampling that
corrects the generator/learner mismatch (different kernels, bf16) without exploding on rare
tokens.

Aggregation (``LossConfig.aggregation``):
* ``sequence`` (GRPO): mean over each sequence's tokens, then mean over sequences.
* ``token`` (DAPO): sum over all tokens / number of tokens.
* Dr.GRPO: sum over tokens / (sequences x a constant length), removing GRPO's length bias.

KL to a frozen reference (``kl_coef`` > 0): k1 = log(pi/ref); k3 = ref/pi - log(ref/pi) - 1
(Schulman's unbiased, non-negative estimator), added per token before aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from relayrl.learner.config import LossConfig


@dataclass
class LossInputs:
    """One micro-batch, all [B, T] except ``advantages`` [B]."""

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None = None


@dataclass
class Totals:
    """Global normalisers of the step (over every rank and micro-batch)."""

    tokens: int
    sequences: int
    max_tokens: int = 1  # Dr.GRPO's constant length (the longest completion allowed)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate.

    >>> lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    >>> round(kl_estimate(lp, ref, "k1").item(), 4), round(kl_estimate(lp, ref, "k3").item(), 4)
    (1.0, 0.3679)
    """
    log_ratio = logprobs - ref_logprobs  # log(pi / ref)
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, totals: Totals) -> torch.Tensor:
    if how == "token":
        return (per_token * mask).sum() / totals.tokens
    if how == "sequence":
        lengths = mask.sum(dim=1).clamp(min=1)
        return ((per_token * mask).sum(dim=1) / lengths).sum() / totals.sequences
    if how == "drgrpo":
        return (per_token * mask).sum() / (totals.sequences * totals.max_tokens)
    raise ValueError(f"unknown aggregation {how!r}")


def aggregation_of(cfg: LossConfig) -> str:
    if cfg.kind == "drgrpo":
        return "drgrpo"
    if cfg.kind == "dapo":
        return "token"
    return cfg.aggregation or ("token" if cfg.kind == "sft" else "sequence")


def policy_loss(inp: LossInputs, cfg: LossConfig, totals: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss, and partial sums for metrics.

    Metrics returned are sums over this micro-batch's counted tokens (``clipped``, ``kl``,
    ``tis_weight``); the caller adds them up and divides by the global token count.
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    how = aggregation_of(cfg)
    if cfg.kind == "sft":
        loss = _aggregate(-inp.logprobs, mask, how, totals)
        return loss, {"clipped": 0.0, "kl": 0.0, "tis_weight": float(mask.sum())}

    adv = inp.advantages.to(inp.logprobs.dtype)[:, None]
    live = mask > 0
    # Log-ratios are zeroed where the mask is 0 *before* exp: a masked token with a huge ratio
    # would give inf * 0 = NaN in the loss and its gradient. The clamp guards counted tokens
    # against overflow (e^20 is already far beyond any clip range).
    behavior_log_ratio = torch.where(live, inp.logprobs - inp.behavior_logprobs, 0.0).clamp(-20.0, 20.0)
    if cfg.tis_cap is not None:
        ratio = torch.exp(inp.logprobs - inp.logprobs.detach())
        weight = torch.exp(behavior_log_ratio.detach()).clamp(max=cfg.tis_cap)
    else:
        ratio = torch.exp(behavior_log_ratio)
        weight = torch.ones_like(ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    per_token = -surrogate * weight
    kl_sum = 0.0
    if cfg.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        ref = torch.where(live, inp.ref_logprobs, inp.logprobs.detach())  # masked: log ratio 0
        kl = kl_estimate(inp.logprobs, ref, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = _aggregate(per_token, mask, how, totals)
    # Tokens whose gradient the clip removed: the clipped branch won the min (as PPO counts it).
    low = (ratio < 1.0 - cfg.clip_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.clip_high) & (adv > 0)
    clipped = (low | high).to(mask.dtype) * mask
    return loss, {
        "clipped": float(clipped.sum()),
        "kl": kl_sum,
        "tis_weight": float((weight * mask).sum()),
    }
