"""The learner with a LoRA adapter (``learner.lora``) on real DeepSpeed ZeRO-3 (CPU, gloo): its
steps equal a plain PEFT model's at 1 and 2 ranks, the base weights never move
(``lora_check.py``)."""

from __future__ import annotations

import pytest

from tests.kit.learner import torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("ranks", [1, 2])
def test_lora_steps_equal_a_plain_peft_step_and_leave_the_base(tiny_model_dir, ranks):
    pytest.importorskip("peft")
    res = torchrun("lora_check.py", str(tiny_model_dir), nproc=ranks)
    assert res.stdout.count("lora steps equal plain PEFT") == 1, res.stdout[-2000:] + res.stderr[-3000:]
