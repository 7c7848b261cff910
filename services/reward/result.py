"""What a scorer returns (its own module: the built-in scorers and the code reward both use it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScoreResult:
    """What a scorer returns: the total reward and its named parts."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
