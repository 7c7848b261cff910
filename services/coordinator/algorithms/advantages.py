"""Group advantages: the rewards of one prompt's G samples -> one advantage per sample.

Pure functions over lists of floats (one group at a time), so they are trivially testable and
independent of the transport. A group whose rewards are all equal carries no signal: every
estimator gives zeros there (the coordinator counts such groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def grpo(rewards: Sequence[float], scale_std: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO: (r - mean) / std over the group (population std); without ``scale_std`` this is
    Dr.GRPO's unbiased variant, r - mean.

    >>> [round(a, 4) for a in grpo([1.0, 0.0, 0.0, 1.0])]
    [1.0, -1.0, -1.0, 1.0]
    >>> grpo([1.0, 0.0, 0.0, 1.0], scale_std=False)
    [0.5, -0.5, -0.5, 0.5]
    >>> grpo([0.3, 0.3])
    [0.0, 0.0]
    """
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + eps) if std > 0 else 0.0 for c in centred]


def rloo(rewards: Sequence[float]) -> list[float]:
    """REINFORCE leave-one-out: r_i minus the mean of the *other* samples' rewards.

    >>> [round(a, 4) for a in rloo([1.0, 0.0, 0.0, 1.0])]
    [0.6667, -0.6667, -0.6667, 0.6667]
    >>> rloo([2.0])
    [0.0]
    """
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def advantages(rewards: Sequence[float], method: str, scale_std: bool = True) -> list[float]:
    """Dispatch by ``algorithm.advantage``: ``grpo``, ``drgrpo`` (no std scaling) or ``rloo``.

    >>> advantages([1.0, 0.0], "drgrpo")
    [0.5, -0.5]
    """
    if method == "grpo":
        return grpo(rewards, scale_std=scale_std)
    if method == "drgrpo":
        return grpo(rewards, scale_std=False)
    if method == "rloo":
        return rloo(rewards)
    raise ValueError(f"unknown advantage method {method!r}")
