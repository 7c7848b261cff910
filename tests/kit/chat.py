"""Small local tokenizers with real chat templates, for the bridge and tool-call tests (no hub).

``chat_tokenizer(family)`` builds a byte-level BPE (the model kit's pipeline) with the family's
special tokens, wrapped in transformers' ``PreTrainedTokenizerFast`` with its chat template:
- ``tiny``: the model kit's own (ChatML plus Qwen2.5-style tool branches);
- ``qwen2_5``: Qwen2.5-Instruct's tool template; ``<tool_call>``/``</tool_call>`` are added
  tokens that are not special, as in Qwen2.5's tokenizer;
- ``llama3_1``: Llama-3.1-Instruct's template (tools in the first user message, one call per
  assistant turn, tool answers as ``ipython`` turns);
- ``qwen3``: Qwen3's (``<think>``, ``</think>`` added, not special), which strips ``<think>`` from assistant turns before the last user query
  (not prefix-preserving).
The templates are in ``tests/kit/templates/``. Built once per process per family.
"""

from __future__ import annotations

import functools
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FAMILIES = {
    # family: (special tokens, non-special added tokens, bos, eos, template file or None: the kit's)
    "tiny": (CHATML, [], None, "<|im_end|>", None),
    "qwen2_5": (CHATML, ["<tool_call>", "</tool_call>"], None, "<|im_end|>", "qwen2_5.jinja"),
    "qwen3": (CHATML, ["<tool_call>", "</tool_call>", "<think>", "</think>"], None, "<|im_end|>", "qwen3.jinja"),
    "llama3_1": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        [], "<|begin_of_text|>", "<|eot_id|>", "llama3_1.jinja",
    ),
}  # fmt: skip
_CORPUS_EXTRA = [
    '{"name": "calc", "arguments": {"expr": "12 * 34"}}',
    '<tool_call>\n{"name": "search", "arguments": {"query": "weather"}}\n</tool_call>',
    "<tool_response>\n408\n</tool_response>",
    "You are a helpful assistant. Use tools when useful.",
]


@functools.cache
def chat_tokenizer(family: str, vocab_size: int = 512):
    from relayrl.common.modelkit.tiny import tokenizer_corpus
    from relayrl.common.modelkit.tokenizer import CHAT_TEMPLATE, train_bpe
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    specials, added, bos, eos, template = FAMILIES[family]
    tok = train_bpe(tokenizer_corpus(0) + _CORPUS_EXTRA * 20, vocab_size=vocab_size, special_tokens=specials)
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0] if family != "llama3_1" else "<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE if template is None else (TEMPLATES / template).read_text()
    return fast
