"""Supervised warm start of a (tiny) model on a built-in task.

GRPO from random init only learns the answer format; exact answers stay at zero because no
sample in a group is ever right, so every advantage is zero. A short supervised warm start on
reference completions gives a policy that is sometimes right: the R1-Zero-like starting point
where RL has something to improve. This is plain cross-entropy on completion tokens, run in
this process with torch; it is a model-kit tool, not the learner service.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTResult:
    """What a warm start did."""

    steps: int
    final_loss: float
    heldout_exact: float
    heldout_n: int


def encode_example(tokenizer, row: dict, completion: str) -> tuple[list[int], list[int]]:
    """Prompt ids (chat template, assistant turn opened) and completion ids (+ end of turn)."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(p) + len(c) for p, c in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, c) in enumerate(examples):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(c)  # loss on the completion only
        mask[i, : len(seq)] = 1
    return ids, labels, mask


def greedy_generate(model, prompts: list[list[int]], pad_id: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy completion ids of one batch of prompt ids (Hugging Face ``generate``), left-padded
    so every prompt ends where generation starts."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out[:, width:].tolist()


def greedy_exact(model, tokenizer, rows: list[dict], completions: list[str], max_new_tokens: int) -> float:
    """Share of ``rows`` whose greedy completion equals the reference completion exactly."""
    import torch

    hits = 0
    pad = tokenizer.pad_token_id
    model.train(False)  # inference mode for generation
    with torch.no_grad():
        for start in range(0, len(rows), 32):
            chunk = [
                encode_example(tokenizer, r, c)
                for r, c in zip(rows[start : start + 32], completions[start : start + 32], strict=True)
            ]
            outs = greedy_generate(model, [p for p, _ in chunk], pad, max_new_tokens)
            for gen, (_, c) in zip(outs, chunk, strict=True):
                if tokenizer.eos_token_id in gen:
                    gen = gen[: gen.index(tokenizer.eos_token_id) + 1]
                hits += gen == c
    model.train()
    return hits / max(1, len(rows))


def warm_start(
    model_dir: str | Path,
    task: str,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int = 32,
    heldout: int = 64,
    task_params: dict | None = None,
) -> SFTResult:
    """Train ``model_dir`` in place for ``steps`` supervised steps on ``task``; save it back."""
    import torch
    from relayrl.common.data.tasks import generate, reference_completion
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = task_params or {}
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rows = generate(task, max(steps * batch_size, batch_size), seed=seed, split="train", **params)
    examples = [encode_example(tokenizer, r, reference_completion(r)) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    order = random.Random(seed)
    loss_value = float("nan")
    for step in range(steps):
        batch = order.sample(examples, batch_size) if len(examples) > batch_size else examples
        ids, labels, mask = _batch(batch, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if step % 25 == 0 or step == steps - 1:
            logger.info("sft step %d/%d loss %.4f", step + 1, steps, loss_value)
    test_rows = generate(task, heldout, seed=seed, split="test", **params)
    refs = [reference_completion(r) for r in test_rows]
    longest = max(len(tokenizer(c)["input_ids"]) for c in refs) + 2
    exact = (
        greedy_exact(model, tokenizer, test_rows, refs, max_new_tokens=longest) if heldout else float("nan")
    )
    model.save_pretrained(model_dir, safe_serialization=True)
    return SFTResult(steps=steps, final_loss=loss_value, heldout_exact=exact, heldout_n=heldout)
