"""A small byte-level BPE tokenizer built exactly like Qwen2's, so every loader agrees on it.

The trap this avoids: in transformers 5, ``AutoTokenizer`` on a ``model_type=qwen2`` folder
builds ``Qwen2Tokenizer`` from ``vocab.json``/``merges.txt`` with Qwen's own normaliser,
pre-tokeniser and decoder, ignoring the pipeline stored in ``tokenizer.json``. vLLM loads the
same way. A tokenizer with any other pipeline (e.g. character-level WordLevel) then silently
changes: spaces vanish. So we train a BPE with Qwen2's pipeline (NFC, Qwen2 split regex
"isolated", ByteLevel without prefix space or regex, ByteLevel decoder): whichever class loads
the folder, the ids are identical. ``tests/unit/test_modelkit.py`` checks that on task strings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's pre-tokenisation regex (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# ChatML, as Qwen2 instruct models use; ``add_generation_prompt`` opens the assistant turn.
# Tools as Qwen2.5 renders them (its instructions shortened): only when ``tools`` are given, a
# system turn lists them in a <tools> block (the dialogue's own system message first); an
# assistant's calls are <tool_call> blocks of {"name", "arguments"} JSON; tool answers are
# <tool_response> blocks inside one user turn per run of consecutive tool messages. Without tools
# a dialogue renders byte for byte as the tool-free template did (tests/unit/test_bridge.py).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOLS_OPEN, TOOLS_CLOSE = "<tools>", "</tools>"
TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each call, write a JSON object with the function name and arguments within "
    '<tool_call></tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + json.dumps(TOOLS_INTRO) + " }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ " + json.dumps(TOOLS_OUTRO) + " + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{ tool_call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(
    corpus: Iterable[str], vocab_size: int = 512, special_tokens: Iterable[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """Train a byte-level BPE on ``corpus``; the 256 byte symbols are always in the vocabulary,
    so any text encodes (no unknown token). Same corpus and size -> same tokenizer.
    ``special_tokens`` take the first ids (ChatML's by default; tests pass other families')."""
    tok = _pipeline(Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json plus the vocab.json/merges.txt that Qwen2Tokenizer rebuilds from."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    merges = state["model"]["merges"]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, sort_keys=False))
    lines = [" ".join(m) if isinstance(m, list) else m for m in merges]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {"eos_token": IM_END, "pad_token": PAD_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
