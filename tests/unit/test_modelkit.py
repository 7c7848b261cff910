"""Model kit: deterministic tiny Qwen2 folders whose tokenizer survives every loader."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from relayrl.common.data.tasks import TASKS, generate, reference_completion


def _task_strings() -> list[str]:
    out = [
        "",
        " leading space",
        "trailing space ",
        "two  spaces\tand a tab\n\nand lines",
        "héllo wörld ✓ 数字",
    ]
    for task in sorted(TASKS):
        for params in ({}, {"trace": True}) if task == "reverse" else ({},):
            for row in generate(task, 20, seed=3, split="test", **params):
                out.append(row["prompt"][-1]["content"])
                out.append(reference_completion(row))
    return out


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir, tmp_path):
    from relayrl.common.modelkit.tiny import write_tiny_model

    again = write_tiny_model(tmp_path / "again", seed=0)
    other = write_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "vocab.json", "merges.txt", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()


def test_auto_tokenizer_equals_the_trained_pipeline(tiny_model_dir):
    """AutoTokenizer rebuilds Qwen2Tokenizer from vocab+merges: ids must not change."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    assert type(auto).__name__ == "Qwen2Tokenizer"
    for s in _task_strings():
        ids = raw.encode(s).ids
        assert auto(s, add_special_tokens=False)["input_ids"] == ids, s
        assert fast(s, add_special_tokens=False)["input_ids"] == ids, s
        assert auto.decode(ids) == s, s  # spaces and newlines survive


def test_chat_template_and_special_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse the digits 123."},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nReverse the digits 123.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens stay whole
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_transformers_loads_and_runs_the_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    card = json.loads((tiny_model_dir / "relayrl_model.json").read_text())
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert card["parameters"] == sum(p.numel() for p in model.parameters())
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % 64 == 0
    logits = model(torch.tensor([tok("Reverse the digits 42.")["input_ids"]])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "kwargs", [{"hidden_size": 200}, {"num_heads": 4, "num_kv_heads": 3}, {"vocab_size": 100}]
)
def test_bad_shapes_are_rejected(kwargs):
    from relayrl.common.modelkit.tiny import TinySpec

    with pytest.raises(ValueError):
        TinySpec(**kwargs)


@pytest.mark.slow
def test_cli_sft_warm_start_learns_the_task(tmp_path):
    """A short warm start takes reverse from 0 to mostly-right greedy answers."""
    out = tmp_path / "warm"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "model",
            "tiny",
            "--out",
            str(out),
            "--task",
            "reverse",
            "--sft-steps",
            "50",
            "--seed",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    card = json.loads((out / "relayrl_model.json").read_text())
    assert card["sft_steps"] == 50 and card["sft_task"] == "reverse"
    assert card["sft_final_loss"] < 0.5
    assert card["sft_heldout_exact"] >= 0.3, card
    assert "held-out greedy exact" in res.stdout


def test_cli_rejects_sft_without_task(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "model",
            "tiny",
            "--out",
            str(tmp_path / "m"),
            "--sft-steps",
            "5",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "--sft-steps needs --task" in res.stderr
