"""The one-rank plain engine against DeepSpeed ZeRO-2, the engine one-rank learners ran before it:
equal steps, ZeRO-2's checkpoints resumed, its own resumed bit for bit, a non-finite step skipped
(``engines_check.py``, one rank under torchrun, float32 on CPU)."""

from __future__ import annotations

import pytest

from tests.kit.learner import torchrun

pytestmark = pytest.mark.slow


def test_the_plain_engine_steps_as_zero2_and_resumes_its_checkpoints(tiny_model_dir, tmp_path):
    res = torchrun("engines_check.py", str(tiny_model_dir), str(tmp_path), nproc=1)
    for line in (
        "plain steps equal ZeRO-2's",
        "a ZeRO-2 checkpoint resumes in the plain engine",
        "the plain engine resumes identically",
        "a non-finite step changes nothing",
        "the micro-batch budget is derived and reported",
    ):
        assert line in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
