"""The TRL side of ``bench/vs_trl.py``: TRL's GRPOTrainer on CPU with HF generation.

Runs in TRL's own environment (``.venv-trl``, made by ``bench/vs_trl.py``), which holds trl, the
same torch and transformers as ``.venv``, and relayrl without extras (data loader and the reward
scorers, both torch-free). Called by ``bench/vs_trl.py``; by hand:

    .venv-trl/bin/python bench/trl_grpo.py --model DIR --train F --test F --out F.jsonl [--steps 40 ...]

Reward: relayrl's own ``score_reverse`` (the function the reward service runs). Held-out
evaluation: greedy HF generation on the test split every ``--eval-every`` steps and at the end,
scored as the coordinator scores its evaluation (the scorer's ``correctness``); its time is
measured and kept out of the training wall time. Every step also records TRL's generation time
and tokens (``_generate_single_turn``) and its reward time (``_calculate_rewards``).

Out, one JSON object per line: ``{"kind": "eval", "step", "wall", "samples", "accuracy",
"seconds"}``, ``{"kind": "step", "step", "wall", "samples", "gen_seconds", "gen_tokens",
"score_seconds"}`` and ``{"kind": "log", "step", ...TRL's logged metrics}``; ``wall`` is the
seconds since training began, without evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def eval_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Prompt ids as the generator service builds them: chat template, assistant turn opened."""
    return [
        tokenizer(
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for r in rows
    ]


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch: int = 64) -> float:
    """Share of ``rows`` whose greedy completion the reverse scorer calls correct."""
    import torch
    from relayrl.common.modelkit.sft import greedy_generate
    from relayrl.reward.scorers import score_reverse

    pad = tokenizer.pad_token_id
    prompts = eval_prompts(tokenizer, rows)
    hits = 0
    was_training = model.training
    model.train(False)
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            outs = greedy_generate(model, prompts[start : start + batch], pad, max_new_tokens)
            texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
            for row, text in zip(rows[start : start + batch], texts, strict=True):
                gt = row["reward_model"]["ground_truth"]
                hits += score_reverse(text, gt, {}).components["correctness"] >= 1.0
    model.train(was_training)
    return hits / max(1, len(rows))


def reverse_reward(completions, ground_truth, **_) -> list[float]:
    """relayrl's reverse scorer as a TRL reward function (conversational completions)."""
    from relayrl.reward.scorers import score_reverse

    return [
        score_reverse(c[-1]["content"], gt, {}).reward
        for c, gt in zip(completions, ground_truth, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from relayrl.common.data.dataset import load_rows
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    out = open(args.out, "w")  # written through the whole run

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    test_rows = load_rows(args.test)
    rows = load_rows(args.train)
    # The coordinator's prompt order (epoch 0 of Experiment._order in relayrl.coordinator.loop),
    # fed unshuffled: both systems train on the same prompts at the same step.
    order = list(range(len(rows)))
    random.Random(args.seed * 100_003).shuffle(order)
    train = Dataset.from_list(
        [
            {"prompt": rows[i]["prompt"], "ground_truth": rows[i]["reward_model"]["ground_truth"]}
            for i in order
        ]
    )
    per_step = args.prompts_per_step * args.n

    class Timed(GRPOTrainer):
        """GRPOTrainer that adds up its generation and reward time per step."""

        gen_seconds = gen_tokens = score_seconds = 0.0

        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **kw)
            Timed.gen_seconds += time.perf_counter() - t0
            Timed.gen_tokens += sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

        def _calculate_rewards(self, *a, **kw):
            t0 = time.perf_counter()
            rewards = super()._calculate_rewards(*a, **kw)
            Timed.score_seconds += time.perf_counter() - t0
            return rewards

    class Clock(TrainerCallback):
        """Training wall time without evaluation; held-out accuracy at step 0, every
        ``--eval-every`` steps and at the end."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.eval_seconds = 0.0

        def wall(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_seconds

        def evaluate(self, model, step: int, wall: float) -> None:
            t = time.perf_counter()
            acc = greedy_accuracy(model, tokenizer, test_rows, args.max_tokens)
            seconds = time.perf_counter() - t
            self.eval_seconds += seconds
            emit(
                {
                    "kind": "eval",
                    "step": step,
                    "wall": wall,
                    "samples": step * per_step,
                    "accuracy": acc,
                    "seconds": seconds,
                }
            )
            print(f"trl step {step}: held-out accuracy {acc:.3f} (eval {seconds:.1f}s)", flush=True)

        def on_train_begin(self, args_, state, control, model=None, **kw):
            self.evaluate(model, 0, 0.0)
            self.t0, self.eval_seconds = time.perf_counter(), 0.0

        def on_log(self, args_, state, control, logs=None, **kw):
            emit({"kind": "log", "step": state.global_step, **(logs or {})})

        def on_step_end(self, args_, state, control, model=None, **kw):
            wall, step = self.wall(), state.global_step
            emit(
                {
                    "kind": "step",
                    "step": step,
                    "wall": wall,
                    "samples": step * per_step,
                    "gen_seconds": Timed.gen_seconds,
                    "gen_tokens": Timed.gen_tokens,
                    "score_seconds": Timed.score_seconds,
                }
            )
            Timed.gen_seconds = Timed.gen_tokens = Timed.score_seconds = 0.0
            if step % args.eval_every == 0 or step == state.max_steps:
                self.evaluate(model, step, wall)

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-output"),
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        seed=args.seed,
        max_steps=args.steps,
        shuffle_dataset=False,
        # One optimizer step per batch of prompts_per_step x n completions, generated at once.
        per_device_train_batch_size=per_step,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # relayrl's grpo: per-sequence token mean, then mean over sequences; group std scaling;
        # clip 0.2 both sides; no KL; AdamW, constant LR, no warm-up, grad norm clipped at 1.
        loss_type="grpo",
        scale_rewards="group",
        beta=0.0,
        epsilon=0.2,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Timed(
        model=model,
        reward_funcs=[reverse_reward],
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
