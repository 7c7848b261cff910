"""A generator killed with SIGKILL leaves no vLLM process behind: its EngineCore (AsyncLLM
always runs one) would otherwise live on as an orphan holding the memory (on GPUs, the GPU
memory) that the generator started again in its place needs. Seen in the chaos suite before
``generator/vllm_plugin.py``: one orphaned EngineCore of 1.2 GB per generator killed.

The same EngineCore, eager on the CPU, runs with torch.compile off
(``vllm_engine.compile_off_in_engine_processes``): vLLM says so from its process."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.procs import service

pytestmark = pytest.mark.slow


def test_a_killed_generator_leaves_no_engine_process(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    args = ["generator", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-model-len", "512"]
    with service(args, tmp_path) as (_addr, proc):
        gen = psutil.Process(proc.proc.pid)
        engine = [p for p in gen.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) + p.name()]
        assert engine, (
            f"no EngineCore under the generator: {[p.name() for p in gen.children(recursive=True)]}"
        )
        # what vLLM logs when it reads the setting, from the EngineCore's own process (its
        # environment cannot be read from outside: setting the process title overwrites it)
        said = [x for x in proc.log_path.read_text().splitlines() if "TORCH_COMPILE_DISABLE is set" in x]
        assert any("EngineCore" in x for x in said), proc.log_path.read_text()[-3000:]
        os.kill(gen.pid, signal.SIGKILL)
        gen.wait(10)
        _, alive = psutil.wait_procs(engine, timeout=15)
        assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
