"""Shared fixtures: tiny local models built once per test session (no model hub anywhere)."""

from __future__ import annotations

import os

import pytest

# vLLM on 2 cores: in-process engine and one OpenMP thread start in seconds (see shared NOTES).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 model folder (seed 0)."""
    from relayrl.common.modelkit.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
