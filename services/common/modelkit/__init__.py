"""Model kit: tiny deterministic Qwen2 models, byte-level BPE tokenizers, SFT warm start."""
