"""``relayrl run`` (and, against a running coordinator, ``status`` / ``list`` / ``stop``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run an experiment (starts local services when none are configured)"
    )
    p.add_argument("experiment", nargs="?", help="experiment YAML (not needed with --resume)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override a config field")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from relayrl.coordinator.config import load_experiment
    from relayrl.coordinator.run import run as run_experiment

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise SystemExit(f"relayrl run --resume: {run_dir} has no config.yaml (not a run folder)")
        if not (run_dir / "checkpoints" / "coordinator.json").exists():
            raise SystemExit(f"relayrl run --resume: {run_dir} has no checkpoint yet")
        cfg = load_experiment(run_dir / "config.yaml", args.set)
        run_experiment(cfg, resume_dir=run_dir)
        return 0
    if not args.experiment:
        raise SystemExit("relayrl run: give an experiment file, or --resume RUN_DIR")
    cfg = load_experiment(args.experiment, args.set)
    run_experiment(cfg)
    return 0
