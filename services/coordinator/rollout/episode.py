"""One multi-turn episode as the episode sources make it (``Episode``: its learner sample, loss
mask, reward result and counts), the step's metrics over a rollout's episodes (``episode_stats``:
tool use, turns, failures) and the trace of the first ones for a person to read (``write_trace``)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from relayrl.common.v1 import common_pb2
from relayrl.reward.v1 import reward_pb2 as rw


@dataclass
class Episode:
    """One episode's sample, loss mask, reward result and counts."""

    sample: common_pb2.Sample
    mask: list[float]
    result: rw.RewardResult
    turns: int = 0
    tool_calls: int = 0  # parsed and sent to the env
    parse_failures: int = 0
    tool_statuses: Counter = field(default_factory=Counter)
    truncated: bool = False
    redone: int = 0
    masked: bool = False
    mask_reason: str = ""
    """Why it was masked (``env_masked_<reason>``): ``episode_lost``, ``agent_silent``,
    ``nothing_to_train`` or the env's own failure kind."""
    malformed_calls: int = 0
    """Tool calls the model wrote that did not parse (black-box: the gateway's count)."""
    segments: list[tuple[common_pb2.Sample, list[float] | None]] | None = None
    """Learner samples of their own, with loss masks: stepwise, one per call; black-box, one per
    segment when the agent's history broke."""
    history_breaks: int = 0  # black-box: requests that did not extend an earlier answer
    calls: list[common_pb2.Sample] = field(default_factory=list)  # the generator's, per turn
    answers: list[list[common_pb2.ChatMessage]] = field(default_factory=list)  # the env's, per turn
    version_spread: int = 0  # newest minus oldest policy version among its turns


def episode_stats(episodes: list[Episode]) -> dict[str, float]:
    """A rollout's episode metrics (``metrics.jsonl``): tool use, turns, failures; masked
    episodes counted by reason (``env_masked_<reason>``, beside their total ``env_masked``).

    >>> e = Episode(common_pb2.Sample(), [1.0], rw.RewardResult(), turns=2, tool_calls=1)
    >>> s = episode_stats([e, Episode(common_pb2.Sample(), [1.0], rw.RewardResult(), turns=1)])
    >>> s["tool_calls_per_episode"], s["turns_per_episode"], s["episodes_without_tool_call"]
    (0.5, 1.5, 1)
    >>> lost = Episode(common_pb2.Sample(), [], rw.RewardResult(), masked=True, mask_reason="episode_lost")
    >>> s = episode_stats([e, lost, lost])
    >>> s["env_masked"], s["env_masked_episode_lost"]
    (2, 2)
    """
    ran = [e for e in episodes if e.turns]
    n = max(1, len(ran))
    statuses: Counter = Counter()
    for e in ran:
        statuses.update(e.tool_statuses)
    out = {
        "tool_calls_per_episode": sum(e.tool_calls for e in ran) / n,
        "turns_per_episode": sum(e.turns for e in ran) / n,
        "episodes_without_tool_call": sum(e.tool_calls == 0 for e in ran),
        "tool_parse_failures": sum(e.parse_failures for e in ran),
        "tool_errors": sum(v for k, v in statuses.items() if k != "TOOL_STATUS_OK"),
        "episodes_truncated": sum(e.truncated for e in ran),
        "env_redo": sum(e.redone for e in episodes),
        "env_masked": sum(e.masked for e in episodes),
        "episode_version_spread_max": max((e.version_spread for e in ran), default=0),
        "history_breaks": sum(e.history_breaks for e in ran),
        "malformed_calls": sum(e.malformed_calls for e in ran),
    }
    reasons = Counter(_reason(e.mask_reason) for e in episodes if e.masked)
    out.update({f"env_masked_{k}": v for k, v in sorted(reasons.items())})
    out.update(
        {f"tool_status_{k.removeprefix('TOOL_STATUS_').lower()}": v for k, v in sorted(statuses.items())}
    )
    return out


def _reason(kind: str) -> str:
    """A mask reason as a metric name's tail: lower case, ``[a-z0-9_]``, at most 40 characters
    (an env's failure kind is its own text).

    >>> _reason("Tool Crashed!"), _reason("")
    ('tool_crashed', 'masked')
    """
    tail = "".join(c if c.isalnum() else "_" for c in kind.lower()[:40]).strip("_")
    return tail or "masked"


def write_trace(path: Path, episodes: list[Episode]) -> None:
    """``episodes`` as JSON lines, one per episode: each turn's generator sample (prompt and
    completion ids, text, parsed tool calls, versions) and the env's answer to it, then the
    learner sample the episode became (ids and loss mask) and its reward result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for e in episodes:
            rec = {
                "turns": [
                    {"call": MessageToDict(c), "answer": [MessageToDict(m) for m in a]}
                    for c, a in zip(
                        e.calls, [*e.answers, *[[]] * (len(e.calls) - len(e.answers))], strict=True
                    )
                ],
                "sample": MessageToDict(e.sample),
                "loss_mask": e.mask,
                "segments": [{"sample": MessageToDict(s), "loss_mask": m} for s, m in e.segments or []],
                "result": MessageToDict(e.result),
            }
            f.write(json.dumps(rec) + "\n")
