"""Per-token advantages of the PPO family: KL-shaped rewards, GAE, REINFORCE++ returns, whitening
and the KL coefficient controllers.

Pure functions over numpy arrays, one sample (a completion's tokens) at a time, plus batch
whitening over a list of samples. ``mask`` marks the tokens that count (1) and those that do not
(0: tokens the policy did not choose, e.g. a tool's output inside a completion); every function
treats a masked token as absent, so a sample's result does not depend on what its masked tokens
hold. Sources are named per function: the papers, and verl's ``verl/trainer/ppo/core_algos.py``
whose conventions PPO users know (rewards on the last token, returns = advantages + values,
advantages whitened over the batch, returns not).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from relayrl.learner.config import K3_BOUND, K3_LOG_RATIO_BOUND

KL_PENALTIES = ("k1", "k2", "k3", "abs")


def _mask(n: int, mask: Sequence[float] | np.ndarray | None) -> np.ndarray:
    m = np.ones(n) if mask is None else np.asarray(mask, dtype=np.float64)
    if m.shape != (n,):
        raise ValueError(f"mask has {m.shape[0] if m.ndim else 0} values for {n} tokens")
    return m


def kl_penalty(
    logprobs: Sequence[float] | np.ndarray, ref_logprobs: Sequence[float] | np.ndarray, kind: str = "k1"
) -> np.ndarray:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs (Schulman, "Approximating
    KL divergence", 2020; verl's ``kl_penalty``): ``k1`` = log(pi/ref), ``k2`` = log(pi/ref)^2 / 2,
    ``k3`` = ref/pi - log(ref/pi) - 1 (verl's ``low_var_kl``, clamped to [-10, 10] as there: the
    learner's ``K3_BOUND``, the same bound as the k3 in the actor's loss),
    ``abs`` = |log(pi/ref)|.

    >>> [round(float(x), 4) for x in kl_penalty([-1.0, -2.0], [-2.0, -1.0], "k1")]
    [1.0, -1.0]
    >>> [round(float(x), 4) for x in kl_penalty([-1.0, -2.0], [-2.0, -1.0], "k3")]
    [0.3679, 0.7183]
    """
    d = np.asarray(logprobs, dtype=np.float64) - np.asarray(ref_logprobs, dtype=np.float64)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = np.clip(d, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)  # no overflow in exp
        return np.clip(np.exp(-d) + d - 1.0, -K3_BOUND, K3_BOUND)
    if kind == "abs":
        return np.abs(d)
    raise ValueError(f"unknown KL penalty {kind!r}; known: {', '.join(KL_PENALTIES)}")


def shaped_rewards(
    score: float, n_tokens: int, kl: np.ndarray | None = None, beta: float = 0.0, mask=None
) -> np.ndarray:
    """Token rewards of one sample: the sequence's score on its last counted token, minus
    ``beta`` times the per-token KL on every counted token (Ziegler et al. 2019, "Fine-Tuning
    Language Models from Human Preferences"; verl's ``apply_kl_penalty``).

    >>> shaped_rewards(1.0, 3).tolist()
    [0.0, 0.0, 1.0]
    >>> shaped_rewards(1.0, 3, kl=np.array([0.5, 0.0, 1.0]), beta=0.1).tolist()
    [-0.05, 0.0, 0.9]
    >>> shaped_rewards(1.0, 3, mask=[1, 1, 0]).tolist()
    [0.0, 1.0, 0.0]
    """
    m = _mask(n_tokens, mask)
    r = np.zeros(n_tokens)
    if kl is not None and beta:
        r -= beta * np.asarray(kl, dtype=np.float64) * m
    counted = np.flatnonzero(m)
    if counted.size:
        r[counted[-1]] += score
    return r


def gae(
    rewards: np.ndarray, values: np.ndarray, gamma: float = 1.0, lam: float = 1.0, mask=None
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"), over one sample's tokens; the state after the last
    token is terminal (value 0). Returns ``(advantages, returns)`` with returns = advantages +
    values, the critic's targets (verl's ``compute_gae_advantage_return``). A masked token is
    skipped: it passes the next counted token's value and advantage through unchanged and gets 0.

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}

    >>> a, ret = gae(np.array([0.0, 1.0]), np.array([0.5, 0.8]), gamma=0.9, lam=0.5)
    >>> [round(float(x), 4) for x in a], [round(float(x), 4) for x in ret]
    ([0.31, 0.2], [0.81, 1.0])
    >>> a, ret = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 9.0, 0.8]), 0.9, 0.5, mask=[1, 0, 1])
    >>> [round(float(x), 4) for x in a], [round(float(x), 4) for x in ret]
    ([0.31, 0.0, 0.2], [0.81, 0.0, 1.0])
    """
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if r.shape != v.shape or r.ndim != 1:
        raise ValueError(f"rewards {r.shape} and values {v.shape} must be one value per token")
    m = _mask(r.shape[0], mask)
    adv = np.zeros_like(r)
    next_value, next_adv = 0.0, 0.0
    for t in range(r.shape[0] - 1, -1, -1):
        if not m[t]:
            continue
        delta = r[t] + gamma * next_value - v[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = v[t]
        adv[t] = next_adv
    return adv, (adv + v) * m


def discounted_returns(rewards: np.ndarray, gamma: float = 1.0, mask=None) -> np.ndarray:
    """Return-to-go of every token, G_t = r_t + gamma G_{t+1}: REINFORCE++'s token-level returns
    (Hu, "REINFORCE++", 2025; verl's ``compute_reinforce_plus_plus_outcome_advantage`` before its
    whitening). A masked token gets 0 and is skipped by the recursion.

    >>> np.round(discounted_returns(np.array([-0.1, 0.0, 1.0]), gamma=0.5), 6).tolist()
    [0.15, 0.5, 1.0]
    >>> discounted_returns(np.array([0.0, 7.0, 1.0]), gamma=0.5, mask=[1, 0, 1]).tolist()
    [0.5, 0.0, 1.0]
    """
    r = np.asarray(rewards, dtype=np.float64)
    m = _mask(r.shape[0], mask)
    out = np.zeros_like(r)
    running = 0.0
    for t in range(r.shape[0] - 1, -1, -1):
        if m[t]:
            running = r[t] + gamma * running
            out[t] = running
    return out


def whiten(samples: Sequence[np.ndarray], masks: Sequence | None = None, shift_mean: bool = True,
           eps: float = 1e-8) -> list[np.ndarray]:  # fmt: skip
    """Whiten per-token values over every counted token of the batch: (x - mean) / sqrt(var + eps),
    var with Bessel's correction (verl's ``masked_whiten``); with ``shift_mean`` False the mean is
    added back (scale only). Masked tokens come out 0.

    >>> [np.round(x, 6).tolist() for x in whiten([np.array([1.0, 3.0]), np.array([5.0])])]
    [[-1.0, 0.0], [1.0]]
    >>> [np.round(x, 6).tolist() for x in whiten([np.array([1.0, 3.0, 100.0]), np.array([5.0])], [[1, 1, 0], None])]
    [[-1.0, 0.0, 0.0], [1.0]]
    """
    ms = [_mask(len(x), None if masks is None else masks[i]) for i, x in enumerate(samples)]
    xs = [np.asarray(x, dtype=np.float64) for x in samples]
    n = sum(float(m.sum()) for m in ms)
    if n < 2:
        return [np.zeros_like(x) for x in xs]  # no spread to measure: no signal either
    mean = sum(float((x * m).sum()) for x, m in zip(xs, ms, strict=True)) / n
    var = sum(float((((x - mean) * m) ** 2).sum()) for x, m in zip(xs, ms, strict=True)) / (n - 1)
    scale = 1.0 / np.sqrt(var + eps)
    return [((x - mean) * scale + (0.0 if shift_mean else mean)) * m for x, m in zip(xs, ms, strict=True)]


def adaptive_kl_coef(coef: float, observed_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019, section 2.2; verl's
    ``AdaptiveKLController``): the proportional error, clipped to +-0.2, moves the coefficient by
    ``error * n_steps / horizon`` (n_steps: samples in the batch).

    >>> round(adaptive_kl_coef(0.1, observed_kl=12.0, target=6.0, horizon=10000, n_steps=256), 6)
    0.100512
    >>> round(adaptive_kl_coef(0.1, observed_kl=3.0, target=6.0, horizon=10000, n_steps=256), 6)
    0.099488
    """
    if target <= 0 or horizon <= 0:
        raise ValueError("target and horizon must be > 0")
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def token_advantages(
    scores: Sequence[float],
    lengths: Sequence[int],
    gamma: float = 1.0,
    lam: float = 1.0,
    values: Sequence[np.ndarray] | None = None,
    kl: Sequence[np.ndarray] | None = None,
    beta: float = 0.0,
    masks: Sequence[Sequence[float] | None] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-token advantages and returns of a batch, PPO's (``values`` given: GAE against the
    critic, verl's ``gae``) or REINFORCE++'s (no values: returns-to-go, verl's
    ``reinforce_plus_plus``). Token rewards are each sample's score on its last token minus
    ``beta`` times its per-token ``kl`` to the reference (the KL in the reward); advantages are
    whitened over every token of the batch, returns (the critic's targets) are not. ``masks``
    (per sample, None for all ones): tokens the model did not generate (a multi-turn episode's
    environment tokens) are absent from every recursion and from the whitening; they get 0.

    >>> adv, ret = token_advantages([1.0, 0.0], [2, 1])  # REINFORCE++: no group baseline
    >>> [np.round(a, 4).tolist() for a in adv], [r.tolist() for r in ret]
    ([[0.5774, 0.5774], [-1.1547]], [[1.0, 1.0], [0.0]])
    >>> adv, ret = token_advantages([1.0, 0.0], [2, 1], values=[np.array([0.5, 0.5]), np.array([0.5])])
    >>> [np.round(a, 4).tolist() for a in adv], [r.tolist() for r in ret]
    ([[0.5774, 0.5774], [-1.1547]], [[1.0, 1.0], [0.0]])
    """
    if len(scores) != len(lengths):
        raise ValueError(f"{len(scores)} scores for {len(lengths)} samples")
    ms = [None] * len(scores) if masks is None else list(masks)
    if len(ms) != len(scores):
        raise ValueError(f"{len(ms)} masks for {len(scores)} samples")
    rewards = [
        shaped_rewards(s, n, None if kl is None else kl[i], beta, ms[i])
        for i, (s, n) in enumerate(zip(scores, lengths, strict=True))
    ]
    if values is None:
        returns = [discounted_returns(r, gamma, m) for r, m in zip(rewards, ms, strict=True)]
        return whiten(returns, ms), returns
    pairs = [
        gae(r, np.asarray(v, dtype=np.float64), gamma, lam, m)
        for r, v, m in zip(rewards, values, ms, strict=True)
    ]
    return whiten([a for a, _ in pairs], ms), [ret for _, ret in pairs]


def reinforce_pp(scores: Sequence[float], lengths: Sequence[int], gamma: float = 1.0) -> list[np.ndarray]:
    """REINFORCE++ token advantages of a batch (verl's ``reinforce_plus_plus`` with the KL in the
    loss rather than in the reward): each sample's score on its last token, returns-to-go with
    ``gamma``, whitened over every token of the batch. No per-prompt baseline: the batch's
    statistics are the baseline, so groups whose samples all scored the same still teach.

    >>> [np.round(a, 4).tolist() for a in reinforce_pp([1.0, 0.0], [2, 1])]
    [[0.5774, 0.5774], [-1.1547]]
    """
    return token_advantages(scores, lengths, gamma)[0]


def explained_variance(values: Sequence[np.ndarray], returns: Sequence[np.ndarray]) -> float:
    """1 - Var(returns - values) / Var(returns) over every token of the batch: how much of the
    returns' spread the critic predicts (1: all, 0: no better than their mean, negative: worse;
    verl's ``critic/vf_explained_var``). NaN when the returns do not vary.

    >>> explained_variance([np.array([1.0, 0.0])], [np.array([1.0, 0.0])])
    1.0
    >>> explained_variance([np.array([0.5, 0.5])], [np.array([1.0, 0.0])])
    0.0
    """
    v = np.concatenate([np.asarray(x, dtype=np.float64) for x in values]) if values else np.zeros(0)
    r = np.concatenate([np.asarray(x, dtype=np.float64) for x in returns]) if returns else np.zeros(0)
    var = float(np.var(r)) if r.size else 0.0
    if var == 0.0:
        return float("nan")
    return 1.0 - float(np.var(r - v)) / var
