"""``relayrl data``: write a task dataset (verl schema) to parquet or JSON lines.

    relayrl data reverse --n 2000 --out data/reverse/train.parquet --min-len 8 --max-len 12 --trace
    relayrl data reverse --n 200 --out data/reverse/test.parquet --split test --min-len 8 --max-len 12 --trace

Train and test files never share a problem, whatever their seeds (see ``tasks``). The top-level
CLI calls :func:`add_parser` and dispatches to :func:`run`; file writing is imported inside ``run``.
"""

from __future__ import annotations

import argparse
from typing import Any

from relayrl.common.data.tasks import SPLITS, TASKS

# CLI flag -> generate() parameter; only flags the user gave are passed, so defaults live in tasks.
_PARAM_FLAGS = {
    "min_len": "--min-len",
    "max_len": "--max-len",
    "trace": "--trace",
    "num_numbers": "--num-numbers",
    "min_operands": "--min-operands",
    "max_operands": "--max-operands",
    "max_value": "--max-value",
    "min_digits": "--min-digits",
    "max_digits": "--max-digits",
    "low": "--low",
    "high": "--high",
    "shots": "--shots",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``data`` subcommand to an ``argparse`` subparsers object; return its parser."""
    p = subparsers.add_parser(
        "data",
        help=f"write a task dataset ({', '.join(TASKS)}) as parquet or jsonl",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("task", choices=sorted(TASKS), help="which task to generate")
    p.add_argument("--n", type=int, required=True, help="number of rows (distinct problems)")
    p.add_argument("--out", required=True, help="output file: .parquet, .jsonl or .json (JSON lines)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--split", choices=SPLITS, default="train", help="train or held-out test problems")
    p.add_argument("--min-len", type=int, help="reverse: shortest digit string (default 3)")
    p.add_argument("--max-len", type=int, help="reverse: longest digit string (default 8)")
    p.add_argument(
        "--trace", action="store_true", default=None, help="reverse: step-by-step <think> completions"
    )
    p.add_argument("--num-numbers", type=int, help="countdown: numbers per problem (default: 3 or 4)")
    p.add_argument("--min-operands", type=int, help="arithmetic: fewest operands (default 2)")
    p.add_argument("--max-operands", type=int, help="arithmetic: most operands (default 3)")
    p.add_argument("--max-value", type=int, help="arithmetic: largest operand (default 99)")
    p.add_argument("--min-digits", type=int, help="calc: fewest digits of a factor (default 3)")
    p.add_argument("--max-digits", type=int, help="calc: most digits of a factor (default 3)")
    p.add_argument("--low", type=int, help="guess: smallest hidden number (default 1)")
    p.add_argument("--high", type=int, help="guess: largest hidden number (default 63)")
    p.add_argument(
        "--shots",
        type=int,
        help="worked examples (training problems) before each prompt, as earlier chat turns (default 0)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Generate the rows and write them; print one line saying what was written."""
    from pathlib import Path

    from relayrl.common.data.dataset import EXTENSIONS, write_rows
    from relayrl.common.data.tasks import generate

    params = {k: getattr(args, k) for k in _PARAM_FLAGS if getattr(args, k, None) is not None}
    spec = TASKS[args.task]
    foreign = [_PARAM_FLAGS[k] for k in params if k not in spec.defaults and k != "shots"]
    if foreign:
        raise SystemExit(f"relayrl data: error: {', '.join(foreign)} does not apply to task {args.task!r}")
    if args.n < 1:
        raise SystemExit(f"relayrl data: error: --n must be >= 1, got {args.n}")
    if Path(args.out).suffix not in EXTENSIONS:
        raise SystemExit(
            f"relayrl data: error: --out must end in one of {', '.join(EXTENSIONS)}, got {args.out!r}"
        )
    try:
        rows = generate(args.task, args.n, args.seed, split=args.split, **params)
    except ValueError as e:  # out-of-range parameters: a usage error, not a crash
        raise SystemExit(f"relayrl data: error: {e}") from e
    path = write_rows(rows, args.out)
    shown = ", ".join(f"{k}={v}" for k, v in {"seed": args.seed, **params}.items())
    print(f"wrote {len(rows)} {args.task} rows (split={args.split}, {shown}) to {path}")
    return 0
