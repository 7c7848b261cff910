"""Samples: decoded from the wire (every problem an InvalidRequest naming the sample, raised on
rank 0 before any collective starts), and padded into a micro-batch's tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from relayrl.common.rpc import InvalidRequest
from relayrl.learner.config import LearnerConfig
from relayrl.learner.packing import Packing, packing
from relayrl.learner.v1 import learner_pb2

MAX_ABS_VALUE = 1e6
"""Largest advantage, return or value magnitude accepted (normalised advantages are a few units;
anything near float limits makes the loss and the gradient infinite)."""
MIN_LOGPROB = -1000.0
"""Lowest generator log-probability accepted, in nats. A sampled token's log-probability is a few
tens of nats at worst (a 150k vocabulary spread evenly is -12); e^-1000 is below the smallest
float64, so nothing sampled has it: -1e30 is a wrong field, not a rare token (unrefused it gave
every token the loss's largest ratio, a loss of 4.85e8)."""


@dataclass
class Sample:
    """One training sample, decoded from the wire."""

    prompt: list[int]
    completion: list[int]
    behavior_logprobs: list[float]
    advantage: float
    loss_mask: list[float]
    token_advantages: list[float] = field(default_factory=list)  # replace ``advantage`` when set
    returns: list[float] = field(default_factory=list)  # critic: value targets
    old_values: list[float] = field(default_factory=list)  # critic: centre of the value clip


@dataclass
class Batch:
    """A micro-batch as tensors on the training device; [B, width] unless stated (the loss's
    layout: each sample's completion from column 0, padded to the longest)."""

    ids: torch.Tensor  # [B, prompt + completion] padded, or [1, all tokens] packed
    targets: torch.Tensor
    behavior: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    starts: list[int]
    width: int
    packing: Packing | None = None
    """Packed: where each sample sits in the one row of ``ids``; None: padded rows."""


def to_batch(batch: list[Sample], device: torch.device, packed: bool = False) -> Batch:
    """Samples -> tensors on ``device`` (the micro-batch a module runs on): the ids as padded
    rows, or with ``packed`` as one row of every sample end to end. Filled in numpy on the host
    (whole lists at a time, no loop over tokens), then two copies to the device (the integers,
    the floats), from pinned memory and without waiting where the device is a GPU."""
    n, width = len(batch), max(len(s.completion) for s in batch)
    if packed:
        ids = np.concatenate([np.asarray(s.prompt + s.completion, dtype=np.int64) for s in batch])[None]
        where = packing([len(s.prompt) for s in batch], [len(s.completion) for s in batch], device)
    else:
        total = max(len(s.prompt) + len(s.completion) for s in batch)
        ids = np.zeros((n, total), dtype=np.int64)
        where = None
    targets = np.zeros((n, width), dtype=np.int64)
    floats = np.zeros((5, n, width), dtype=np.float32)  # behavior, mask, adv, returns, old values
    behavior, mask, adv, returns, old_values = floats
    for i, s in enumerate(batch):
        c = len(s.completion)
        if not packed:
            ids[i, : len(s.prompt)] = s.prompt
            ids[i, len(s.prompt) : len(s.prompt) + c] = s.completion
        targets[i, :c] = s.completion
        if s.behavior_logprobs:
            behavior[i, :c] = s.behavior_logprobs
        mask[i, :c] = s.loss_mask if s.loss_mask else 1.0
        adv[i, :c] = s.token_advantages if s.token_advantages else s.advantage
        if s.returns:
            returns[i, :c] = s.returns
        if s.old_values:
            old_values[i, :c] = s.old_values
    ints = _to_device(np.concatenate([ids.reshape(-1), targets.reshape(-1)]), device)
    ids_t, targets_t = ints.split([ids.size, targets.size])
    behavior_t, mask_t, adv_t, returns_t, old_values_t = _to_device(floats, device)
    return Batch(
        ids_t.view(ids.shape),
        targets_t.view(n, width),
        behavior_t,
        mask_t,
        adv_t,
        returns_t,
        old_values_t,
        [len(s.prompt) for s in batch],
        width,
        where,
    )


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(a)
    if device.type == "cuda":  # a pinned source lets the copy run without blocking the host
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def check_tokens(where: str, prompt, completion, vocab_size: int, max_len: int) -> None:
    """A sequence the model can run: non-empty parts, ids in the vocabulary, within its length."""
    n = len(completion)
    if not prompt or not n:
        raise InvalidRequest(f"{where}: prompt_token_ids and completion_token_ids must be non-empty")
    if len(prompt) + n > max_len:
        raise InvalidRequest(f"{where}: {len(prompt) + n} tokens exceed the model's {max_len}")
    if min(min(prompt), min(completion)) < 0 or max(max(prompt), max(completion)) >= vocab_size:
        raise InvalidRequest(f"{where}: token ids must be in [0, {vocab_size})")


def _first_bad(values, ok) -> tuple[int, float] | None:
    """The first value (index, value) for which ``ok`` (vectorised over an array) is False, or
    None: one numpy pass per field, not a Python comparison per token."""
    a = np.asarray(values, dtype=np.float64)
    bad = ~ok(a)
    if not bad.any():
        return None
    t = int(bad.argmax())
    return t, float(a[t])


def _finite_per_token(where: str, name: str, values, n: int, required: bool) -> None:
    if (values or required) and len(values) != n:
        raise InvalidRequest(f"{where}: {len(values)} {name} for {n} completion tokens")
    if values and (got := _first_bad(values, lambda a: np.abs(a) <= MAX_ABS_VALUE)):  # NaN too
        raise InvalidRequest(
            f"{where}: {name}[{got[0]}] is {got[1]:g}; each must be finite, |x| <= {MAX_ABS_VALUE:g}"
        )


def _check_logprobs(where: str, logprobs) -> None:
    """Log-probabilities of sampled tokens: in [MIN_LOGPROB, 0] (NaN refused too); names the first
    bad token."""
    if logprobs and (got := _first_bad(logprobs, lambda a: (a >= MIN_LOGPROB) & (a <= 0.0))):
        raise InvalidRequest(
            f"{where}: generator_logprobs[{got[0]}] is {got[1]:g}; a log-probability must be in "
            f"[{MIN_LOGPROB:g}, 0]"
        )


def decode_samples(
    req: learner_pb2.TrainStepRequest, vocab_size: int, max_len: int, cfg: LearnerConfig
) -> list[Sample]:
    """Wire samples -> ``Sample``; every problem raises InvalidRequest naming the sample. What a
    sample must carry depends on the role: an actor trains on advantages and needs the generator's
    log-probs (but SFT), a critic trains on returns (and the old values its clip is centred on)."""
    if not req.samples:
        raise InvalidRequest("samples is empty: nothing to train on")
    critic = cfg.role == "critic"
    sft = cfg.loss.kind == "sft" and not critic
    out = []
    for i, s in enumerate(req.samples):
        n = len(s.completion_token_ids)
        where = f"samples[{i}]"
        check_tokens(where, s.prompt_token_ids, s.completion_token_ids, vocab_size, max_len)
        if critic:
            _finite_per_token(where, "returns", s.returns, n, required=True)
            _finite_per_token(where, "values", s.values, n, required=cfg.loss.value_clip is not None)
        if not (len(s.generator_logprobs) == n or ((sft or critic) and not s.generator_logprobs)):
            raise InvalidRequest(
                f"{where}: {len(s.generator_logprobs)} generator_logprobs for {n} completion tokens"
            )
        if s.loss_mask and len(s.loss_mask) != n:
            raise InvalidRequest(f"{where}: {len(s.loss_mask)} loss_mask values for {n} completion tokens")
        if s.loss_mask and _first_bad(s.loss_mask, lambda a: (a >= 0.0) & (a <= 1.0)):  # NaN too
            raise InvalidRequest(f"{where}: loss_mask values must be in [0, 1]")
        if not abs(s.advantage) <= MAX_ABS_VALUE:  # also refuses NaN
            raise InvalidRequest(
                f"{where}: advantage is {s.advantage:g}; |advantage| must be <= {MAX_ABS_VALUE:g}"
            )
        _finite_per_token(where, "token_advantages", s.token_advantages, n, required=False)
        _check_logprobs(where, s.generator_logprobs)
        out.append(
            Sample(
                list(s.prompt_token_ids),
                list(s.completion_token_ids),
                list(s.generator_logprobs),
                float(s.advantage),
                list(s.loss_mask),
                list(s.token_advantages),
                list(s.returns),
                list(s.values),
            )
        )
    return out


def decode_sequences(seqs, vocab_size: int, max_len: int) -> list[Sample]:
    """ComputeLogprobs / ComputeValues sequences -> ``Sample`` (nothing to train on: no advantage,
    no log-probs)."""
    if not seqs:
        raise InvalidRequest("sequences is empty: nothing to score")
    out = []
    for i, s in enumerate(seqs):
        check_tokens(f"sequences[{i}]", s.prompt_token_ids, s.completion_token_ids, vocab_size, max_len)
        out.append(Sample(list(s.prompt_token_ids), list(s.completion_token_ids), [], 0.0, []))
    return out
