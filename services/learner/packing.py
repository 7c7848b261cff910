"""Packed micro-batches: a rank's samples concatenated into rows of at most a token budget, with
no padding, and the tensors a packed forward takes.

A packed micro-batch is one row: every sample's prompt and completion one after the other,
``position_ids`` restarting at 0 at each sample, and ``cu_seq_lens`` (cumulative lengths) for the
attention function (``attention.py``), so each sample attends only to itself. The loss side does
not change: the hidden states that predict completion tokens are gathered out of the row
(``pred``), the LM head runs on those rows only, and the per-token results are scattered into the
same ``[samples, longest completion]`` layout a padded micro-batch has (``rows``, ``cols``), so
every loss, mask and metric reads them as before.

The budget is of real tokens: a sample longer than it gets a micro-batch of its own. Samples are
placed longest first into the first micro-batch with room (first-fit decreasing), which fills
micro-batches within a few percent of the budget on realistic length mixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def pack(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """``indices`` into micro-batches of at most ``max_tokens`` tokens in all (first-fit
    decreasing; each micro-batch's samples longest first).

    >>> pack([0, 1, 2, 3], [5, 3, 4, 2], 7)
    [[0, 3], [2, 1]]
    >>> pack([0, 1], [9, 2], 8)
    [[0], [1]]
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        k = next((k for k, r in enumerate(room) if r >= lengths[i]), None)
        if k is None:
            bins.append([i])
            room.append(max_tokens - lengths[i])
        else:
            bins[k].append(i)
            room[k] -= lengths[i]
    return bins


@dataclass
class Packing:
    """Where a packed micro-batch's samples sit, on the training device."""

    position_ids: torch.Tensor
    """[1, T]: each sample's positions from 0."""
    cu_seq_lens: torch.Tensor
    """[samples + 1] int32: where each sample starts in the row, then the row's length."""
    max_length: int
    """The longest sample."""
    pred: torch.Tensor
    """[N] long: positions in the row whose hidden state predicts each completion token (N of
    them in all, sample by sample)."""
    rows: torch.Tensor
    """[N] long: the sample of each completion token."""
    cols: torch.Tensor
    """[N] long: its index within its sample's completion."""

    def model_kwargs(self) -> dict:
        """What the backbone takes besides the ids (transformers hands the varlen ones to the
        attention function; ``use_cache=False``: no KV cache is built in training)."""
        return {
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            "use_cache": False,
        }

    def scatter(self, flat: torch.Tensor, width: int) -> torch.Tensor:
        """Per completion token values [N] (or [1, N]) -> [samples, width], 0 elsewhere
        (differentiable)."""
        out = flat.new_zeros(len(self.cu_seq_lens) - 1, width)
        return out.index_put((self.rows, self.cols), flat.reshape(-1))


def packing(prompt_lens: list[int], completion_lens: list[int], device: torch.device) -> Packing:
    """The ``Packing`` of samples with these prompt and completion lengths, in row order: index
    arithmetic in numpy (no loop over tokens), then one copy to ``device``.

    >>> p = packing([2, 1], [2, 3], torch.device("cpu"))
    >>> p.position_ids.tolist(), p.cu_seq_lens.tolist(), p.max_length
    ([[0, 1, 2, 3, 0, 1, 2, 3]], [0, 4, 8], 4)
    >>> p.pred.tolist(), p.rows.tolist(), p.cols.tolist()
    ([1, 2, 4, 5, 6], [0, 0, 1, 1, 1], [0, 1, 0, 1, 2])
    """
    prompts = np.asarray(prompt_lens, dtype=np.int64)
    completions = np.asarray(completion_lens, dtype=np.int64)
    lens = prompts + completions
    starts = np.concatenate([[0], np.cumsum(lens)])
    total, n = int(starts[-1]), int(completions.sum())
    pos = np.arange(total) - np.repeat(starts[:-1], lens)
    rows = np.repeat(np.arange(len(lens)), completions)
    cols = np.arange(n) - np.repeat(np.cumsum(completions) - completions, completions)
    # the last prompt token predicts the first completion token
    pred = np.repeat(starts[:-1] + prompts - 1, completions) + cols
    host = torch.from_numpy(np.concatenate([pos, pred, rows, cols, starts]))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    pos_t, pred_t, rows_t, cols_t, starts_t = flat.split([total, n, n, n, len(starts)])
    return Packing(
        pos_t[None],
        starts_t.to(torch.int32),
        int(lens.max()) if len(lens) else 0,
        pred_t,
        rows_t,
        cols_t,
    )
