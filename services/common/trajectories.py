"""A multi-turn episode's turns as one learner sample, token-exact (pure functions).

Turn k's prompt is turn k-1's prompt and completion, exactly, followed by the environment's
answer as the chat template renders it (the generator's bridge: ``common.v1.Continuation``). So
the episode is one token stream: the first prompt, then each completion and the environment
tokens between completions. The sample the learner trains on is that stream with the first
prompt as its prompt and everything after it as its completion; its loss mask is 1 on the tokens
the model generated and 0 on the environment's, whose log-probs are 0 (the learner requires a
finite log-prob <= 0 and ignores masked ones). Nothing is ever re-tokenized, so the learner scores
exactly the tokens the generator sampled."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.common.v1 import common_pb2

TEMPLATE_TOKENS_PER_MESSAGE = 64
"""Tokens a chat template adds around one appended message, at most (role headers, tool-answer
tags, the generation prompt): with one token per byte of content at most (byte-level BPE), the
bound on a turn's appended tokens that keeps the next prompt inside the episode's budget."""


def turn_room(
    max_tokens: int, max_episode_tokens: int, used: int, appended: Sequence[common_pb2.ChatMessage]
) -> int:
    """Most tokens the next turn may generate: ``max_tokens``, and what the episode's budget
    (``max_episode_tokens`` after its first prompt) leaves after the ``used`` tokens so far and an
    upper estimate of the ``appended`` messages' tokens. Below 1: the episode is out of room.

    >>> m = common_pb2.ChatMessage(role="tool", content="56088")
    >>> turn_room(48, 160, 20, [m]), turn_room(48, 100, 20, [m])
    (48, 11)
    """
    bound = sum(
        len(m.content.encode())
        + sum(len(c.arguments_json) for c in m.tool_calls)
        + TEMPLATE_TOKENS_PER_MESSAGE
        for m in appended
    )
    return min(max_tokens, max_episode_tokens - used - bound)


class PrefixViolation(RuntimeError):
    """A turn's prompt does not start with the previous turn's exact tokens: the generator
    re-rendered the dialogue, and what would train is not what was sampled."""


def check_prefix(prefix: Sequence[int], s: common_pb2.Sample, where: str) -> None:
    """Raise ``PrefixViolation`` unless ``s``'s prompt starts with ``prefix`` exactly.

    >>> s = common_pb2.Sample(prompt_token_ids=[1, 2, 3, 9])
    >>> check_prefix([1, 2, 3], s, "e/0 turn 1")
    >>> try:
    ...     check_prefix([1, 2, 4], s, "e/0 turn 1")
    ... except PrefixViolation as e:
    ...     print(e)
    e/0 turn 1: the prompt differs from the previous turn's tokens at position 2 of 3 (token 3, not 4)
    """
    got = s.prompt_token_ids
    n = len(prefix)
    if len(got) >= n and list(got[:n]) == list(prefix):
        return
    at = next((k for k in range(min(n, len(got))) if got[k] != prefix[k]), min(n, len(got)))
    seen = got[at] if at < len(got) else "none"
    raise PrefixViolation(
        f"{where}: the prompt differs from the previous turn's tokens at position {at} of {n} "
        f"(token {seen}, not {prefix[at] if at < n else 'none'})"
    )


def _spans(s: common_pb2.Sample) -> list[tuple[int, int, int]]:
    n = len(s.completion_token_ids)
    if s.version_spans:
        return [(v.version, v.start, v.end) for v in s.version_spans]
    return [(s.policy_version, 0, n)] if n else []


def assemble(
    turns: Sequence[common_pb2.Sample], prompt_id: str, index: int
) -> tuple[common_pb2.Sample, list[float]]:
    """The episode as one sample and its loss mask. ``turns`` are the samples of its turns in
    order, each prompt extending the previous turn's prompt + completion (``check_prefix``).
    Version spans cover the whole completion: environment tokens carry the version of the turn
    that read them; the sample's policy version is its first turn's.

    >>> t0 = common_pb2.Sample(prompt_token_ids=[1, 2], completion_token_ids=[3, 4], logprobs=[-0.5, -0.1], policy_version=7)
    >>> t1 = common_pb2.Sample(prompt_token_ids=[1, 2, 3, 4, 8, 9], completion_token_ids=[5], logprobs=[-0.2], policy_version=8)
    >>> s, mask = assemble([t0, t1], "p", 0)
    >>> list(s.prompt_token_ids), list(s.completion_token_ids), mask
    ([1, 2], [3, 4, 8, 9, 5], [1.0, 1.0, 0.0, 0.0, 1.0])
    >>> [round(x, 2) for x in s.logprobs], [(v.version, v.start, v.end) for v in s.version_spans]
    ([-0.5, -0.1, 0.0, 0.0, -0.2], [(7, 0, 2), (8, 2, 5)])
    """
    first = turns[0]
    start = len(first.prompt_token_ids)
    completion: list[int] = []
    logprobs: list[float] = []
    mask: list[float] = []
    spans: list[tuple[int, int, int]] = []
    for s in turns:
        env = list(s.prompt_token_ids[start + len(completion) :])  # the bridge: environment tokens
        version = _spans(s)[0][0] if s.completion_token_ids else s.policy_version
        if env:
            spans.append((version, len(completion), len(completion) + len(env)))
            completion += env
            logprobs += [0.0] * len(env)
            mask += [0.0] * len(env)
        off = len(completion)
        spans += [(v, off + a, off + b) for v, a, b in _spans(s)]
        completion += s.completion_token_ids
        logprobs += s.logprobs
        mask += [1.0] * len(s.completion_token_ids)
    merged: list[tuple[int, int, int]] = []
    for v, a, b in spans:
        if merged and merged[-1][0] == v and merged[-1][2] == a:
            merged[-1] = (v, merged[-1][1], b)
        else:
            merged.append((v, a, b))
    last = turns[-1]
    sample = common_pb2.Sample(
        prompt_id=prompt_id,
        sample_index=index,
        prompt_token_ids=first.prompt_token_ids,
        completion_token_ids=completion,
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        policy_version=merged[0][0] if merged else first.policy_version,
        version_spans=[common_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in merged]
        if len(merged) > 1
        else [],
        replica_id=last.replica_id,
        text="".join(t.text for t in turns),
    )
    return sample, mask


def segments_sample(turns: Sequence[common_pb2.Sample], prompt_id: str, index: int) -> common_pb2.Sample:
    """The sample that stands for a step-wise episode in its group (its turns train as samples of
    their own): the first call's tokens, the oldest policy version of any call, the last call's
    finish reason, every call's text.

    >>> t0 = common_pb2.Sample(prompt_token_ids=[1], completion_token_ids=[2], policy_version=4, text="a")
    >>> t1 = common_pb2.Sample(prompt_token_ids=[1, 2, 9], completion_token_ids=[3], policy_version=5, text="b")
    >>> s = segments_sample([t0, t1], "p", 1)
    >>> s.prompt_id, s.sample_index, s.policy_version, s.text
    ('p', 1, 4, 'ab')
    """
    first = turns[0]
    oldest = min(v for t in turns for v in [t.policy_version, *(sp.version for sp in t.version_spans)])
    return common_pb2.Sample(
        prompt_id=prompt_id,
        sample_index=index,
        prompt_token_ids=first.prompt_token_ids,
        completion_token_ids=first.completion_token_ids,
        logprobs=first.logprobs,
        finish_reason=turns[-1].finish_reason,
        policy_version=oldest,
        replica_id=turns[-1].replica_id,
        text="".join(t.text for t in turns),
    )
