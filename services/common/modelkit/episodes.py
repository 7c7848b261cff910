"""Multi-turn supervised warm start: episodes as token traces, trained with a loss mask.

A trace is one episode as the RL loop sees it: the first prompt as the chat template renders it,
then each model turn's tokens (through its end-of-turn token), and between turns the tokens the
chat codec's bridge appends (the environment's answer and the next generation prompt). The
loss mask is 1 on the model's tokens and 0 on the prompt and the bridge's, exactly the mask
``common.trajectories.assemble`` gives an RL episode of the same actions. The codec is
passed in (duck-typed: ``render``, ``bridge``, ``end_of_turn_ids``; the generator's
``ChatCodec``), so SFT and RL extend dialogues with one implementation.

In: a codec, an episode's first messages, tools, and its turns as (assistant message, the
environment's answer) pairs. Out: ``Trace`` (ids, mask); ``train_traces`` trains a model folder
on them in place; ``play`` runs greedy episodes with Hugging Face ``generate`` for a held-out
measure. Plain torch in this process, like ``sft.py``: a model-kit tool, not the learner.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class Codec(Protocol):
    """What traces need of a chat codec (``relayrl.generator.bridge.ChatCodec`` is one)."""

    end_of_turn_ids: frozenset[int]

    def render(
        self, messages: Sequence[Message], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    def bridge(self, prefix: Sequence[int], append: Sequence[Message], tools: Any = None) -> list[int]: ...


@dataclass(frozen=True)
class Trace:
    """One episode's token ids and its loss mask (1: the model's token, 0: prompt or bridge)."""

    ids: list[int]
    mask: list[int]


def turn_ids(codec: Codec, head: Sequence[Message], tools: Any, message: Message) -> list[int]:
    """The model's tokens for the assistant turn ``message`` after dialogue ``head``: what the
    template renders after the generation prompt, through the end-of-turn token (kept). ValueError
    when the template's assistant turn does not follow its generation prompt."""
    opened = codec.render(head, tools, add_generation_prompt=True)
    closed = codec.render([*head, message], tools, add_generation_prompt=False)
    rest = closed[len(opened) :]
    end = next((k for k, t in enumerate(rest) if t in codec.end_of_turn_ids), None)
    if closed[: len(opened)] != opened or end is None:
        raise ValueError("the chat template's assistant turn does not follow its generation prompt")
    return rest[: end + 1]


def episode_trace(
    codec: Codec, first: Sequence[Message], tools: Any, turns: Sequence[tuple[Message, Sequence[Message]]]
) -> Trace:
    """The trace of an episode: ``first`` rendered with the generation prompt, then each turn's
    assistant tokens, and before every turn but the first the bridge over the previous turn's
    answer (``codec.bridge``, as the generator extends a continuation).

    ``turns``: (assistant message, the environment's messages after it); the last turn's answer
    is not rendered (the episode ends there)."""
    ids = codec.render(first, tools, add_generation_prompt=True)
    mask = [0] * len(ids)
    head = list(first)
    for k, (message, _) in enumerate(turns):
        if k:
            extended = codec.bridge(ids, turns[k - 1][1], tools)
            mask += [0] * (len(extended) - len(ids))
            ids = extended
        out = turn_ids(codec, head, tools, message)
        ids, mask = [*ids, *out], [*mask, *[1] * len(out)]
        head += [message, *turns[k][1]]
    return Trace(ids, mask)


def _batch(traces: Sequence[Trace], pad_id: int):
    import torch

    width = max(len(t.ids) for t in traces)
    ids = torch.full((len(traces), width), pad_id, dtype=torch.long)
    labels = torch.full((len(traces), width), -100, dtype=torch.long)
    attention = torch.zeros((len(traces), width), dtype=torch.long)
    for i, t in enumerate(traces):
        seq = torch.tensor(t.ids)
        ids[i, : len(t.ids)] = seq
        attention[i, : len(t.ids)] = 1
        keep = torch.tensor(t.mask, dtype=torch.bool)
        labels[i, : len(t.ids)] = torch.where(keep, seq, torch.full_like(seq, -100))  # model tokens only
    return ids, labels, attention


def shared_prefix(traces: Sequence[Trace]) -> int:
    """Leading tokens every trace has in common (the system turn and tools, the same in every
    episode), stopping before the first token that is trained on or precedes one: they need
    computing once per batch, not once per trace (``train_traces``).

    >>> shared_prefix([Trace([1, 2, 3, 4, 5], [0, 0, 0, 0, 1]), Trace([1, 2, 3, 9, 9], [0, 0, 0, 1, 1])])
    2
    """
    first = traces[0].ids
    common = min(
        next(
            (k for k, (a, b) in enumerate(zip(first, t.ids, strict=False)) if a != b),
            min(len(first), len(t.ids)),
        )
        for t in traces
    )
    trained = min(t.mask.index(1) if 1 in t.mask else len(t.mask) for t in traces)
    return max(0, min(common, trained - 1))


def batch_loss(model, traces: Sequence[Trace], pad_id: int, shared: int = 0):
    """Mean cross-entropy over the traces' trained tokens; their first ``shared`` tokens (the
    same in each, none trained: ``shared_prefix``) run once, their keys and values repeated."""
    ids, labels, attention = _batch(traces, pad_id)
    if not shared:
        return model(input_ids=ids, attention_mask=attention, labels=labels).loss
    cache = model(input_ids=ids[:1, :shared], use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(traces))  # differentiable: the prefix's gradients sum over traces
    return model(
        input_ids=ids[:, shared:], attention_mask=attention, past_key_values=cache, labels=labels[:, shared:]
    ).loss


def train_traces(
    model,
    traces: Sequence[Trace],
    pad_id: int,
    steps: int,
    seed: int,
    lr: float,
    batch_size: int,
    passed: Callable[[], bool] | None = None,
    max_steps: int | None = None,
    check_every: int = 100,
) -> tuple[float, int]:
    """AdamW steps of cross-entropy on the traces' masked tokens (linear warm-up over the first
    tenth of ``steps``); (the last loss, the steps run). ``steps`` of them, then, with ``passed``,
    ``check_every`` more at a time until ``passed()`` or ``max_steps``: a tiny model can sit on a
    loss plateau for hundreds of steps before it learns to copy, and a fixed count stops some
    seeds on it. The tokens all traces share (``shared_prefix``) run once per batch and their
    keys and values are repeated for every trace: the same loss and gradients as a forward pass
    over whole traces, a few times faster when the prefix is most of a trace."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    order = random.Random(seed)
    shared = shared_prefix(traces)
    model.train()
    loss_value, step, goal = float("nan"), 0, steps
    limit = max(steps, max_steps or steps)
    while step < goal:
        batch = order.sample(list(traces), batch_size) if len(traces) > batch_size else list(traces)
        loss = batch_loss(model, batch, pad_id, shared)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        step += 1
        if step % 25 == 1 or step == goal:
            logger.info("episode sft step %d/%d loss %.4f", step, goal, loss_value)
        if step == goal and passed is not None and goal < limit and not passed():
            goal = min(limit, goal + check_every)
    return loss_value, step


def reproduced(model, traces: Sequence[Trace], pad_id: int, skip: int = 1, batch_size: int = 32) -> float:
    """Share of ``traces`` whose trained tokens, after each trace's first ``skip`` (the branch an
    episode takes), are all the model's argmax given the trace before them: the episodes greedy
    decoding plays token for token once it has taken their first token. One teacher-forced
    forward pass per batch, no generation: a cheap held-out check of what a warm start learned
    (copying the question into a call, the tool's answer into the reply)."""
    import torch

    hits = 0
    model.train(False)
    with torch.no_grad():
        for start in range(0, len(traces), batch_size):
            chunk = traces[start : start + batch_size]
            ids, labels, attention = _batch(chunk, pad_id)
            pred = model(input_ids=ids, attention_mask=attention).logits.argmax(-1)
            for i, t in enumerate(chunk):
                trained = [k for k, m in enumerate(t.mask) if m][skip:]
                hits += all(int(pred[i, k - 1]) == t.ids[k] for k in trained)
    model.train()
    return hits / max(1, len(traces))


class Player(Protocol):
    """One episode played greedily: its first prompt ids, and the environment's side of a turn."""

    ids: list[int]

    def step(self, completion: list[int]) -> list[Message] | None:
        """The environment's answer to the model's turn (its tokens, end-of-turn included);
        None when the episode is over."""


def play(
    model,
    codec: Codec,
    players: Sequence[Player],
    tools: Any,
    pad_id: int,
    max_new_tokens: int,
    max_turns: int,
    generate: Callable,
) -> None:
    """Play ``players``' episodes greedily, all turns of a round in one batch: each turn's
    completion is cut at its end-of-turn token, handed to its player, and the player's answer is
    bridged onto the exact ids (``codec.bridge``) for the next turn. ``generate`` is
    ``sft.greedy_generate``."""
    import torch

    live = list(players)
    model.train(False)
    with torch.no_grad():
        for _ in range(max_turns):
            if not live:
                break
            outs = generate(model, [p.ids for p in live], pad_id, max_new_tokens)
            nxt = []
            for p, out in zip(live, outs, strict=True):
                end = next((k for k, t in enumerate(out) if t in codec.end_of_turn_ids), None)
                turn = out[: end + 1] if end is not None else out
                answer = p.step(turn)
                if answer is not None and end is not None:
                    p.ids = codec.bridge([*p.ids, *turn], answer, tools)
                    nxt.append(p)
            live = nxt
    model.train()


def sample_generate(model, prompts: list[list[int]], pad_id: int, max_new_tokens: int) -> list[list[int]]:
    """``sft.greedy_generate``'s batch, sampled at temperature 1 (the policy as RL samples it)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_id,
    )
    return out[:, width:].tolist()


def load(model_dir: str | Path):
    """(model, tokenizer) of a folder, float32, for training in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer
