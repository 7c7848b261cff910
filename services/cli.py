"""The ``relayrl`` command. Thin on purpose: parse, then import only what the subcommand needs,
so ``relayrl --help`` answers without loading torch, vLLM or DeepSpeed."""

from __future__ import annotations

import argparse
import sys

from relayrl import __version__
from relayrl.common import logcontext
from relayrl.common.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from relayrl import serve_cli
    from relayrl.common.data import cli as data_cli
    from relayrl.common.modelkit import cli as model_cli
    from relayrl.coordinator import cli as coordinator_cli

    parser = argparse.ArgumentParser(
        prog="relayrl", description="RL post-training of LLMs over decoupled gRPC services."
    )
    parser.add_argument("--version", action="version", version=f"relayrl {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_cli.add_parser(sub)
    data_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    coordinator_cli.add_parser(sub)
    coordinator_cli.add_launch_parser(sub)
    coordinator_cli.add_client_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logcontext.configure(args.log_level.upper())
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"relayrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
