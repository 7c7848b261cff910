"""The CPU's counterpart of the CUDA allocator's peak (``bench/learner.py``'s ``tensor_peak_mb``):
what the memory targets of the learner benchmark are read from on a CPU."""

from __future__ import annotations

import torch

from bench.learner import tensor_peak_mb


def test_tensor_peak_counts_live_tensors_once_and_the_steps_highest_point():
    held = torch.ones(2 << 20)  # 8 MiB live before the step
    view = held[: 1 << 20]  # a view: the same storage, not counted twice

    def step():
        a = torch.ones(1 << 20)  # 4 MiB
        b = torch.ones(1 << 20)  # 4 MiB more: 8 MiB above the start at the highest point
        del a, b
        c = torch.ones(1 << 19)  # 2 MiB after the highest point: not a new peak
        del c

    got = tensor_peak_mb(step)
    # other tensors the interpreter holds (this process's imports) add a little, never less
    assert 16.0 <= got < 16.0 + 8.0, got
    assert view.data_ptr() == held.data_ptr()
