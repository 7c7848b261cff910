"""``relayrl serve SERVICE``: build a service's config from a YAML section, flags and ``--set``,
then start the service in the foreground.

``SERVICES`` (at the end) is the one table of what can be served: each service's config model,
how it starts, and the few short flags kept by hand. Every other flag is made from the model
(``relayrl.common.flags``): one per field, its help the field's docstring and its default the
field's, so ``relayrl serve SERVICE --help`` is the config's reference and cannot drift from it.
Precedence: the ``--config`` file, then the flags, then ``--set PATH=VALUE``, validated once.
Heavy imports (vLLM, DeepSpeed, torch) happen only after parsing, in the service's ``start``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from relayrl.common import config as cfg
from relayrl.common import flags
from relayrl.coordinator.config import CoordinatorServeConfig
from relayrl.env.config import EnvConfig
from relayrl.gateway.config import GatewayConfig
from relayrl.generator.config import GeneratorConfig
from relayrl.learner.config import LearnerConfig
from relayrl.reward.config import RewardConfig


@dataclass(frozen=True)
class Service:
    """One service ``relayrl serve`` runs."""

    config: type[BaseModel]
    """Its config model: every field is a flag."""
    start: Callable[[Any, argparse.Namespace], int]
    """Runs it with its validated config (and the parsed flags); returns the exit status."""
    flat: tuple[str, ...] = ("serve",)
    """Sections whose fields are flags under their own names too (``--port`` for ``serve.port``)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Further short flags, kept by hand because scripts and deploy files use them: flag -> field."""
    launcher_flags: Callable[[argparse.ArgumentParser], None] | None = None
    """Adds the flags of its launcher, which are not config fields (the learner's torchrun)."""


@dataclass(frozen=True)
class Server:
    """``start`` of a service whose ``module.run(config, port_file)`` serves it until SIGTERM;
    what ``run`` returns, if anything, is why the process exits with status 1 (to be restarted)."""

    module: str
    """The server module, imported only once the config is valid (it brings the engines)."""
    before: Callable[[], object] | None = None
    """Runs first: settings of the process that the module's imports must see."""

    def __call__(self, config, args: argparse.Namespace) -> int:
        if self.before is not None:
            self.before()
        run = importlib.import_module(self.module).run
        died = asyncio.run(run(config, args.port_file))
        if died:
            raise SystemExit(f"{died}: exiting with status 1 to be restarted")
        return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run one service (generator, ...) in the foreground")
    sub = p.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, service in SERVICES.items():
        s = sub.add_parser(
            name,
            help=f"serve relayrl.{name}.v1",
            usage="%(prog)s [--config FILE] [--set PATH=VALUE] [--port-file FILE] [FLAG VALUE ...]",
            description=f"Serve relayrl.{name}.v1. Its config ({service.config.__name__}) comes from "
            "--config, then the flags below, then --set, in that order.",
            formatter_class=flags.HelpFormatter,
            allow_abbrev=False,  # a command line says every flag in full
        )
        s.add_argument("--config", help="YAML file holding this service's config section")
        s.add_argument(
            "--set", action="append", default=[], metavar="PATH=VALUE", help="override a config field"
        )
        s.add_argument("--port-file", help="write the bound gRPC port here once serving")
        if service.launcher_flags is not None:
            service.launcher_flags(s)
        made = flags.add_flags(s, service.config, flat=service.flat, aliases=service.aliases)
        s.set_defaults(func=run, _flags=made)


def build_config(args: argparse.Namespace):
    """The service's config: the ``--config`` file, the flags given, then ``--set``."""
    data = cfg.read_yaml(args.config) if args.config is not None else {}
    for path, value in flags.given(args, args._flags).items():
        flags.put(data, path, value)
    return cfg.build(SERVICES[args.service].config, data, args.set, source=args.config or "")


def eager_without_compiler() -> bool:
    """vLLM torch.compiles a few sampler functions even with ``enforce_eager``; on a CPU, inductor
    builds them with a C++ compiler, and where there is none (a slim image, a bare machine) the
    first sample kills the engine ("InvalidCxxCompiler: No working C++ compiler"). There, run
    them eagerly (TORCHDYNAMO_DISABLE: same results, no compile). Returns whether it did."""
    if os.environ.get("TORCHDYNAMO_DISABLE") is not None:
        return False  # the operator's choice
    if any(shutil.which(c) for c in (os.environ.get("CXX"), "g++") if c):  # what inductor tries
        return False
    import torch

    if torch.version.cuda or getattr(torch.version, "hip", None):
        return False  # a GPU build of torch (asked without touching the driver): Triton compiles
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    logging.getLogger("relayrl").info(
        "no C++ compiler on this machine: vLLM's compiled sampler ops run eagerly"
    )
    return True


def run(args: argparse.Namespace) -> int:
    from relayrl.common.lifeline import exit_with_parent

    exit_with_parent()  # started by a launcher that owns it: end with it
    config = build_config(args)
    check_access(args.service, config.serve)
    logging.getLogger("relayrl").setLevel(min(logging.INFO, logging.getLogger().level))
    return SERVICES[args.service].start(config, args)


def vllm_on_this_host() -> None:
    """On CPU, vLLM's in-process engine with one OpenMP thread starts in seconds and runs as
    fast; users on GPUs keep vLLM's defaults."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    eager_without_compiler()


def check_access(service: str, serve) -> None:
    """Refuse an open bind, or unreadable certificates and token, before anything slow starts
    (model loading, scoring workers, torchrun ranks)."""
    from relayrl.common.security import SecurityError, server_security

    try:
        server_security(serve)
    except SecurityError as e:
        raise SystemExit(f"relayrl serve {service}: {e}") from None


def slurm_rank_env(config, args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """torch.distributed's variables for one rank srun started (``--rank-from-slurm``).

    >>> a = argparse.Namespace(master_addr="n1", master_port=None, rendezvous_file="/runs/r/rdzv/l.port")
    >>> e = slurm_rank_env(argparse.Namespace(world_size=2), a, {"SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    ...                    "SLURM_NTASKS": "2"})
    >>> e["RANK"], e["RELAYRL_RENDEZVOUS_FILE"], "MASTER_PORT" in e
    ('1', '/runs/r/rdzv/l.port', False)
    """
    from relayrl.learner.config import RENDEZVOUS_FILE_VAR

    missing = [v for v in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS") if v not in env]
    if missing:
        raise SystemExit(f"learner --rank-from-slurm: {', '.join(missing)} unset: start it with srun")
    if int(env["SLURM_NTASKS"]) != config.world_size:
        raise SystemExit(
            f"learner: srun started {env['SLURM_NTASKS']} tasks for world_size {config.world_size}"
        )
    rendezvous = getattr(args, "rendezvous_file", None)
    if not args.master_addr or not (args.master_port or rendezvous):
        raise SystemExit(
            "learner --rank-from-slurm: --master-addr and --master-port (or --rendezvous-file) are required"
        )
    out = {
        "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "MASTER_ADDR": args.master_addr,
    }
    if rendezvous:  # rank 0's store binds a free port and publishes it there
        out[RENDEZVOUS_FILE_VAR] = rendezvous
    else:
        out["MASTER_PORT"] = str(args.master_port)
    return out


def launch_learner(config, args: argparse.Namespace) -> int:
    """Exec torchrun with one process per local rank (``relayrl.learner.rank``); this process
    as the one rank when there is one (torchrun's agent would only watch it, for ~1.5 CPU-s and
    a second at every start); with ``--rank-from-slurm`` this process as one rank srun started."""
    import sys
    import tempfile

    if not config.model:
        raise SystemExit("learner: model (--model) is required")

    def config_file() -> str:
        fd, path = tempfile.mkstemp(prefix="relayrl-learner-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(cfg.dump_yaml(config))
        return path

    def exec_rank(env: dict[str, str]) -> None:
        os.environ.update(env)
        port_file = ["--port-file", args.port_file] if args.port_file else []
        cmd = [sys.executable, "-m", "relayrl.learner.rank", "--config", config_file(), *port_file]
        os.execv(sys.executable, cmd)

    if getattr(args, "rank_from_slurm", False):
        exec_rank(slurm_rank_env(config, args, dict(os.environ)))
    if getattr(args, "rendezvous_file", None):  # torchrun's agent holds its own rendezvous
        raise SystemExit("learner: --rendezvous-file goes with --rank-from-slurm (ranks srun started)")
    nnodes = args.nnodes or 1
    if config.world_size % nnodes:
        raise SystemExit(f"learner: world_size {config.world_size} is not a multiple of --nnodes {nnodes}")
    port = args.master_port or None  # 0 names no port: torchrun's static rendezvous would wait on it
    if port is None and nnodes > 1:
        raise SystemExit("learner: --master-port is required with several nodes")
    addr = args.master_addr or "127.0.0.1"
    # No port named (one node): the rendezvous store binds a free one itself and holds it (the
    # one rank's store at port 0; torchrun's agent store with --standalone). A port picked here
    # and closed again can be taken before the store binds it: EADDRINUSE at start, seen in CI.
    if config.world_size == 1:
        one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        exec_rank({**one, "MASTER_ADDR": addr, "MASTER_PORT": str(port or 0)})
    if port is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={nnodes}", f"--node_rank={args.node_rank or 0}"]
        rendezvous += [f"--master_addr={addr}", f"--master_port={port}"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={config.world_size // nnodes}",
        *rendezvous,
        "-m",
        "relayrl.learner.rank",
        "--config",
        config_file(),
        *(["--port-file", args.port_file] if args.port_file else []),
    ]
    logging.getLogger(__name__).info("launching: %s", " ".join(cmd))
    os.execv(sys.executable, cmd)


def torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """The learner's launcher flags: torchrun's rendezvous, or ranks that srun started."""
    g = parser.add_argument_group("launcher", "How the ranks start (not config fields).")
    g.add_argument("--nnodes", type=int, help="nodes taking part (default 1)")
    g.add_argument("--node-rank", type=int, help="this node's rank (default 0)")
    g.add_argument("--master-addr", help="rank 0's host for the training rendezvous (default 127.0.0.1)")
    g.add_argument("--master-port", type=int, help="rendezvous port (default: a free one, single node only)")
    g.add_argument(
        "--rank-from-slurm",
        action="store_true",
        help="this process is one rank, started by srun (one task per rank): its rank from "
        "SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS, no torchrun; --master-addr and "
        "--master-port (or --rendezvous-file) name rank 0's rendezvous",
    )
    g.add_argument(
        "--rendezvous-file",
        help="with --rank-from-slurm, instead of --master-port: rank 0's store binds a free port "
        "and writes it to this file, which the other ranks read (a path every node shares)",
    )


SERVICES: dict[str, Service] = {
    "generator": Service(
        GeneratorConfig,
        Server("relayrl.generator.server", before=vllm_on_this_host),
        flat=("serve", "engine"),
    ),
    "learner": Service(
        LearnerConfig,
        launch_learner,
        aliases={"--lr": "optim.lr", "--loss": "loss.kind"},
        launcher_flags=torchrun_flags,
    ),
    "reward": Service(RewardConfig, Server("relayrl.reward.server"), aliases={"--plugin": "plugins"}),
    "coordinator": Service(CoordinatorServeConfig, Server("relayrl.coordinator.service.server")),
    "env": Service(EnvConfig, Server("relayrl.env.server"), aliases={"--plugin": "plugins"}),
    "gateway": Service(
        GatewayConfig,
        Server("relayrl.gateway.server"),
        aliases={
            "--generator": "generators",
            "--http-host": "http.host",
            "--http-port": "http.port",
            "--public-url": "http.public_url",
        },
    ),
}
"""What ``relayrl serve`` runs: service name -> config model, start, short flags."""
