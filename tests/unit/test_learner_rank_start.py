"""What a CPU learner rank loads at start: every rank start of every run pays for it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import os, sys
    # Port 0, as the launcher sets it for one rank: the rank's store binds a free port itself.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from relayrl.learner.rank import init_distributed

    init_distributed(with_deepspeed=True)
    # what building a ZeRO engine imports (DeepSpeed's optimizer check)
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    print("inductor loaded:", "torch._inductor.compile_fx" in sys.modules)
    """
)


def test_a_cpu_rank_does_not_load_the_compiler_deepspeed_would_never_use():
    """DeepSpeed's import wraps its Muon optimizer in torch.compile, which loads inductor (~0.8
    CPU-s); a CPU rank compiles nothing, so it turns torch.compile off before that import."""
    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inductor loaded: False" in out.stdout, out.stdout + out.stderr[-2000:]
