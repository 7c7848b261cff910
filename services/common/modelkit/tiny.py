"""Deterministic tiny Qwen2 models for tests, demos and CI, written as ordinary HF folders.

A folder made here is indistinguishable from a downloaded checkpoint: ``config.json``,
``model.safetensors``, ``generation_config.json`` and a Qwen2-style tokenizer. Every loader in
relayrl (vLLM, DeepSpeed, transformers) therefore takes the same code path on it as on a real
model. Sizes respect vLLM's CPU attention (head_dim in {32, 64, 80, 96, 112, 128, ...}).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Generic text next to the task strings, so common words are single tokens in demos too.
_GENERIC = (
    "You are a helpful assistant. Think step by step, then answer.",
    "The answer is 42. Let me check: 6 * 7 = 42, so the answer is correct.",
    "Question: what is the sum of 12 and 30? Answer: 42.",
)

_TOOL_TEXT = [
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "123 * 456"}}\n</tool_call>',
    "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>",
    '{"type": "function", "function": {"name": "calc", "description": "", "parameters": {}}}',
    "<tools></tools>",
]


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. The default is ~2.6M parameters."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 1024

    def __post_init__(self) -> None:
        head_dim, rem = divmod(self.hidden_size, self.num_heads)
        if rem or head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 256):
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be a head_dim "
                "vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < 300:
            raise ValueError("vocab_size must be >= 300 (256 bytes + special tokens + merges)")


def tokenizer_corpus(seed: int, tools: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """Texts the tokenizer is trained on: every built-in task's prompts and completions; with
    ``tools``, also the chat template's tool text (``<tool_call>`` blocks, ``<tool_response>``,
    the ``<tools>`` instructions) as ordinary text, so tool turns take few tokens and skip-special
    decoding keeps them. Off by default: it changes the vocabulary, and existing tiny models (and
    what was measured on them) must stay as they are. ``extra``: more texts, last (an env's own
    prompts and answers for a model warm-started on its episodes); none by default."""
    from relayrl.common.data.tasks import SINGLE_TURN_TASKS, generate, reference_completion
    from relayrl.common.modelkit.tokenizer import TOOLS_INTRO, TOOLS_OUTRO

    corpus = list(_GENERIC) + ["system", "user", "assistant"]
    for task in sorted(SINGLE_TURN_TASKS):  # a fixed list: a new task must not change old models
        params = {"trace": True} if task == "reverse" else {}
        for row in generate(task, 200, seed=seed, split="train", **params):
            corpus.append(row["prompt"][-1]["content"])
            corpus.append(reference_completion(row))
    if tools:
        corpus += [TOOLS_INTRO + TOOLS_OUTRO] + _TOOL_TEXT * 50
    return corpus + list(extra)


def write_tiny_model(
    out: str | Path,
    seed: int = 0,
    spec: TinySpec | None = None,
    tools: bool = False,
    extra_corpus: Sequence[str] = (),
) -> Path:
    """Write a random-init tiny Qwen2 model and its tokenizer to ``out``; returns the folder.
    ``tools``: a tokenizer trained on the tool text too; ``extra_corpus``: and on these texts
    (``tokenizer_corpus``).

    Same seed and spec -> byte-identical safetensors and tokenizer files.
    """
    import torch
    from relayrl.common.modelkit.tokenizer import IM_END, PAD_TOKEN, save_tokenizer, train_bpe
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinySpec()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(tokenizer_corpus(seed, tools=tools, extra=extra_corpus), vocab_size=spec.vocab_size)
    save_tokenizer(tok, out, model_max_length=spec.max_position_embeddings)
    # Pad the embedding to a multiple of 64 (as real models do); ids beyond the tokenizer's
    # vocabulary are never produced by it but are valid rows for the model.
    vocab = -(-tok.get_vocab_size() // 64) * 64
    eos, pad = tok.token_to_id(IM_END), tok.token_to_id(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    _write_card(out, seed, spec, sum(p.numel() for p in model.parameters()))
    if tools:
        update_card(out, tool_tokens=True)
    return out


def _write_card(out: Path, seed: int, spec: TinySpec, n_params: int) -> None:
    card = {"made_by": "relayrl model tiny", "seed": seed, "parameters": n_params, **spec.__dict__}
    (out / "relayrl_model.json").write_text(json.dumps(card, indent=2) + "\n")


def update_card(out: Path, **fields: object) -> None:
    """Record what was done to a model folder (e.g. the SFT warm start and its accuracy)."""
    path = Path(out) / "relayrl_model.json"
    card = json.loads(path.read_text()) if path.exists() else {}
    card.update(fields)
    path.write_text(json.dumps(card, indent=2) + "\n")
