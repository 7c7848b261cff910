"""Helpers of the learner tests: deterministic batches, and scripts run under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from relayrl.learner.v1 import learner_pb2 as lp

ROOT = Path(__file__).resolve().parents[2]


def batch(seed: int, n: int = 6) -> list[lp.TrainSample]:
    """A deterministic batch: varied lengths, mixed-sign advantages, plausible logprobs."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(2, 12)
        out.append(
            lp.TrainSample(
                prompt_token_ids=[rng.randrange(3, 300) for _ in range(rng.randint(3, 9))],
                completion_token_ids=[rng.randrange(3, 300) for _ in range(k)],
                generator_logprobs=[-rng.uniform(4.5, 7.0) for _ in range(k)],
                advantage=(1.0 if i % 2 else -1.0) * rng.uniform(0.5, 1.5),
                policy_version=0,
            )
        )
    return out


def torchrun(script: str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run ``tests/integration/<script>`` under torchrun with ``nproc`` ranks; ``--standalone``:
    torchrun's agent binds the rendezvous store's port itself (a port picked first could be taken)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    res = subprocess.run(
        [*cmd, str(ROOT / "tests/integration" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res
