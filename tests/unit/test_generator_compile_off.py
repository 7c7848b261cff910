"""``compile_off_in_engine_processes``: torch.compile off in the processes vLLM starts while it
is in effect (they read ``TORCH_COMPILE_DISABLE`` at their import of torch), this process's
environment as it was afterwards, whatever it held. The engine's own processes are checked on the
real engine in ``tests/integration/test_generator_lifeline.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from relayrl.generator.vllm_engine import compile_off_in_engine_processes

KEY = "TORCH_COMPILE_DISABLE"


def _child_sees() -> str:
    code = f"import os; print(os.environ.get({KEY!r}, '-'))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout.strip()


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_children_started_inside_have_compile_off_and_the_environment_is_restored(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(KEY, raising=False)
    else:
        monkeypatch.setenv(KEY, before)
    with compile_off_in_engine_processes(True):
        assert _child_sees() == "1"
    assert os.environ.get(KEY) == before
    with compile_off_in_engine_processes(False):  # compiling engines (GPUs) keep what was set
        assert os.environ.get(KEY) == before


def test_an_exception_inside_restores_the_environment(monkeypatch):
    monkeypatch.delenv(KEY, raising=False)
    with pytest.raises(RuntimeError), compile_off_in_engine_processes(True):
        raise RuntimeError("the engine failed to start")
    assert KEY not in os.environ
