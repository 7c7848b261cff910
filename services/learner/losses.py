"""Policy losses of the GRPO family, as pure functions of per-token tensors.

Inputs are per-token tensors of shape [B, T] over completion tokens (``mask`` is 1 where a token
counts) and advantages per sequence [B] or per token [B, T]. The functions return a *partial sum*: the micro-batch's
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

Importance weights (``tis_mode``, with ``tis_cap``): per token w_t = pi/pi_behavior capped
(``token_truncate``) or zeroed above the cap (``token_mask``); per sequence the product of its
token ratios, capped or zeroed likewise (``sequence_*``), as TRL's
``vllm_importance_sampling_mode``.

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per sequence, s_i =
exp(mean_t log(pi/pi_behavior)), clipped as PPO's; per token GSPO-token's sg[s_i] pi/sg[pi], so
each token's gradient carries the sequence's ratio. Aggregated per sequence (mean of means).

KL to a frozen reference (``kl_coef`` > 0): k1 = log(pi/ref); k2 = log(pi/ref)^2 / 2; k3 =
ref/pi - log(ref/pi) - 1 (Schulman's unbiased, non-negative estimator, clamped to ``K3_BOUND`` as
the reward's k3 is, verl's bound), added per token before aggregation; with ``kl_ratio``
multiplied by the policy's ratio (TRL's bias-corrected KL).

Learner/generator agreement (actors with behaviour log-probs, not SFT): ``logprob_abs_diff`` sums
|logp - behavior| over counted tokens, from the log-probs the loss already has (no second
forward); ``after_env_abs_diff`` the same over only the first ``AFTER_ENV_WINDOW`` counted tokens
after each masked span, and ``after_env_weight`` their mask weight. In a multi-turn episode the
masked spans are the environment's tokens (tool answers the chat template rendered): a template or
bridge bug shows there first, as a spike right after the bridge, which a mean over the whole
completion dilutes. Weighted by the mask value, as every other token mean.

Value loss of the critic (PPO; verl's ``compute_value_loss``): 0.5 max((V - R)^2, (clip(V,
V_old - c, V_old + c) - R)^2) per token, aggregated as the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from relayrl.learner.config import K3_BOUND, K3_LOG_RATIO_BOUND, LossConfig

AFTER_ENV_WINDOW = 8
"""Counted tokens after each masked (environment) span that ``after_env_abs_diff`` watches."""
POLICY_SUMS = ("clipped", "kl", "tis_weight")
BEHAVIOR_SUMS = ("logprob_abs_diff", "after_env_abs_diff", "after_env_weight")


@dataclass
class LossInputs:
    """One micro-batch, all [B, T]; ``advantages`` [B, T] per token or [B] per sequence."""

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
    """Per-token KL(pi || ref) estimate; k3 clamped as the reward's (``K3_BOUND``: the log-ratio
    before the exponential, then the estimate), so its gradient stays bounded far from the reference.

    >>> lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    >>> round(kl_estimate(lp, ref, "k1").item(), 4), round(kl_estimate(lp, ref, "k3").item(), 4)
    (1.0, 0.3679)
    >>> kl_estimate(torch.tensor([-31.0]), torch.tensor([-1.0]), "k3").item()
    10.0
    """
    log_ratio = logprobs - ref_logprobs  # log(pi / ref)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        d = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return (torch.exp(-d) + d - 1.0).clamp(-K3_BOUND, K3_BOUND)
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


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, mode: str) -> torch.Tensor:
    """Per-token weights [B, T] from the (detached, masked) log-ratios to the behaviour policy.

    >>> lr = torch.log(torch.tensor([[0.5, 4.0], [1.5, 1.0]]))
    >>> m = torch.ones(2, 2)
    >>> importance_weights(lr, m, 2.0, "token_truncate").tolist()
    [[0.5, 2.0], [1.5, 1.0]]
    >>> importance_weights(lr, m, 2.0, "token_mask").tolist()
    [[0.5, 0.0], [1.5, 1.0]]
    >>> [[round(x, 4) for x in row] for row in importance_weights(lr, m, 1.8, "sequence_truncate").tolist()]
    [[1.8, 1.8], [1.5, 1.5]]
    >>> [[round(x, 4) for x in row] for row in importance_weights(lr, m, 1.8, "sequence_mask").tolist()]
    [[0.0, 0.0], [1.5, 1.5]]
    """
    if mode.startswith("sequence"):
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True).clamp(max=20.0).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    if mode.endswith("mask"):
        return torch.where(ratio > cap, 0.0, ratio)
    raise ValueError(f"unknown importance sampling mode {mode!r}")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    how: str,
    totals: Totals,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss (all [B, T]), the micro-batch's share as ``policy_loss``'s;
    metrics are sums over counted tokens (``vf_clipped``: tokens where the clipped term won), as
    0-dim tensors on the values' device (the caller reads them once per step, not per micro-batch).

    >>> t = torch.tensor
    >>> loss, m = value_loss(t([[2.0, 0.0]]), t([[1.0, 0.0]]), t([[3.0, 1.0]]), t([[1.0, 1.0]]), 0.5,
    ...                      "token", Totals(tokens=2, sequences=1))
    >>> round(loss.item(), 4), m["vf_clipped"].item()  # 0.5 * mean(max(1, 2.25), max(1, 1)) = 0.8125
    (0.8125, 1.0)
    """
    mask = mask.to(values.dtype)
    err = (values - returns) ** 2
    if clip is None:
        per_token, clipped = err, torch.zeros_like(err)
    else:
        delta = values - old_values
        err_clipped = (old_values + delta.clamp(-clip, clip) - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
        # Counted from the comparison, not from the round trip: old + (v - old) is v give or take
        # one ulp, enough for err_clipped > err on a token the clip never touched.
        clipped = ((delta.abs() > clip) & (err_clipped > err)).to(values.dtype)
    loss = _aggregate(0.5 * per_token, mask, how, totals)
    return loss, {
        "vf_clipped": (clipped * mask).sum().detach(),
        "vf_sq_err": (err.detach() * mask).sum(),
    }


def after_masked_span(mask: torch.Tensor, window: int = AFTER_ENV_WINDOW) -> torch.Tensor:
    """[B, T] bool: the first ``window`` counted tokens (mask > 0) after each masked span of a row.
    A masked span is one or more tokens of mask 0 followed by a counted token; the padding after a
    row's end is none (nothing counted follows it).

    >>> m = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1], [0, 0.5, 1, 1, 1, 1, 1, 1, 1]])
    >>> after_masked_span(m, 2).int().tolist()
    [[0, 0, 0, 0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0]]
    """
    live = mask > 0
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    # Index of the latest masked token at or before each position (-1: none yet in the row).
    last_masked = torch.where(live, -1, pos).cummax(dim=1).values
    return live & (last_masked >= 0) & (pos - last_masked <= window)


def behavior_gap(
    logprobs: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums of |logp - behavior| over counted tokens, all of them and those right after a masked
    span (``BEHAVIOR_SUMS``), weighted by the mask. Masked tokens never count: the environment's
    tokens carry no generator log-prob (0.0 on the wire).

    >>> lp, beh = torch.tensor([[-1.0, -2.0, -3.0, -1.5]]), torch.tensor([[-1.1, 0.0, -2.0, -1.5]])
    >>> {k: round(v.item(), 4) for k, v in behavior_gap(lp, beh, torch.tensor([[1.0, 0.0, 0.5, 1.0]])).items()}
    {'logprob_abs_diff': 0.6, 'after_env_abs_diff': 0.5, 'after_env_weight': 1.5}
    """
    mask = mask.to(torch.float64)
    live = mask > 0
    gap = torch.where(live, (logprobs.detach().double() - behavior.double()).abs(), 0.0) * mask
    after = after_masked_span(mask).to(mask.dtype)
    return {
        "logprob_abs_diff": gap.sum(),
        "after_env_abs_diff": (gap * after).sum(),
        "after_env_weight": (mask * after).sum(),
    }


def policy_sums(cfg: LossConfig) -> tuple[str, ...]:
    """The metric sums ``policy_loss`` returns under ``cfg``: SFT has no behaviour log-probs."""
    return POLICY_SUMS if cfg.kind == "sft" else POLICY_SUMS + BEHAVIOR_SUMS


def aggregation_of(cfg: LossConfig) -> str:
    if cfg.kind == "drgrpo":
        return "drgrpo"
    if cfg.kind == "dapo":
        return "token"
    if cfg.kind == "gspo":
        return "sequence"
    return cfg.aggregation or ("token" if cfg.kind == "sft" else "sequence")


def policy_loss(
    inp: LossInputs, cfg: LossConfig, totals: Totals
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step loss, and partial sums for metrics.

    Metrics returned are sums over this micro-batch's counted tokens (``policy_sums``), 0-dim
    tensors on the log-probs' device, detached; the caller adds them up (on the device: one read
    per step) and divides by the global token count (``after_env_abs_diff`` by the sum of
    ``after_env_weight``).
    """
    mask = inp.mask.to(inp.logprobs.dtype)
    how = aggregation_of(cfg)
    if cfg.kind == "sft":
        loss = _aggregate(-inp.logprobs, mask, how, totals)
        zero = mask.new_zeros(())
        return loss, {"clipped": zero, "kl": zero, "tis_weight": mask.sum()}

    adv = inp.advantages.to(inp.logprobs.dtype)
    adv = adv[:, None] if adv.ndim == 1 else adv
    live = mask > 0
    # Log-ratios are zeroed where the mask is 0 *before* exp: a masked token with a huge ratio
    # would give inf * 0 = NaN in the loss and its gradient. The clamp guards counted tokens
    # against overflow (e^20 is already far beyond any clip range).
    behavior_log_ratio = torch.where(live, inp.logprobs - inp.behavior_logprobs, 0.0).clamp(-20.0, 20.0)
    if cfg.kind == "gspo":
        seq_log_ratio = behavior_log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(
            min=1
        )
        ratio = torch.exp(seq_log_ratio.detach() + inp.logprobs - inp.logprobs.detach())
        weight = torch.ones_like(ratio)
    elif cfg.tis_cap is not None:
        ratio = torch.exp(inp.logprobs - inp.logprobs.detach())
        weight = importance_weights(behavior_log_ratio.detach(), mask, cfg.tis_cap, cfg.tis_mode)
    else:
        ratio = torch.exp(behavior_log_ratio)
        weight = torch.ones_like(ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    per_token = -surrogate * weight
    kl_sum = mask.new_zeros(())
    if cfg.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        ref = torch.where(live, inp.ref_logprobs, inp.logprobs.detach())  # masked: log ratio 0
        kl = kl_estimate(inp.logprobs, ref, cfg.kl_estimator)
        if cfg.kl_ratio:
            kl = kl * ratio
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = (kl.detach() * mask).sum()
    loss = _aggregate(per_token, mask, how, totals)
    # Tokens whose gradient the clip removed: the clipped branch won the min (as PPO counts it).
    low = (ratio < 1.0 - cfg.clip_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.clip_high) & (adv > 0)
    clipped = (low | high).to(mask.dtype) * mask
    return loss, {
        "clipped": clipped.sum().detach(),
        "kl": kl_sum,
        "tis_weight": (weight.detach() * mask).sum(),
        **behavior_gap(inp.logprobs, inp.behavior_logprobs, inp.mask),
    }
