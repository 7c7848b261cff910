"""The CPU's counterpart of the CUDA allocator's peak (``bench/learner.py``'s ``tensor_peak_mb``):
what the memory targets of the learner benchmark are read from on a CPU."""

from __future__ import annotations

import gc

import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.learner import tensor_peak_mb


def test_tensor_peak_counts_live_tensors_once_and_the_steps_highest_point():
    # a fake tensor left alive by tracing, as torch.compile leaves them in a worker that ran
    # another test first (CI failed on it): it owns no memory and, made as torch.compile makes
    # it, its data pointer raises, so the walk must pass over it
    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False), FakeTensorMode():
        fake = torch.ones(1 << 20)
    gc.collect()
    # what this worker already holds (earlier tests' tensors, imports): the figures below are
    # read above it, so they do not depend on which tests ran here first
    before = tensor_peak_mb(lambda: None)
    held = torch.ones(2 << 20)  # 8 MiB live before the step
    view = held[: 1 << 20]  # a view: the same storage, not counted twice

    def step():
        a = torch.ones(1 << 20)  # 4 MiB
        b = torch.ones(1 << 20)  # 4 MiB more: 8 MiB above the start at the highest point
        del a, b
        c = torch.ones(1 << 19)  # 2 MiB after the highest point: not a new peak
        del c

    got = tensor_peak_mb(step) - before
    assert 16.0 <= got < 16.5, got
    assert view.data_ptr() == held.data_ptr()
    assert fake.shape == (1 << 20,)
