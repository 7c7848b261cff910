"""``relayrl serve SERVICE``: build a service's config from a YAML section, flags and ``--set``,
then hand it to the service's ``server.run``. Heavy imports happen only after parsing."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil

from relayrl.common import config as cfg

# flag -> (config path, type, help). Flags are shortcuts for --set PATH=VALUE; type ``list`` makes a
# repeatable flag whose values form the list, type ``bool`` a switch that sets true.
_COMMON = {
    "--host": ("serve.host", str, "address to bind (default 127.0.0.1; others need TLS or --insecure)"),
    "--port": ("serve.port", int, "gRPC port (0: pick a free one)"),
    "--metrics-port": ("serve.metrics_port", int, "Prometheus metrics port (0: pick a free one)"),
    "--grace-seconds": ("serve.grace_seconds", float, "drain time on SIGTERM"),
    "--tls-cert": ("serve.tls_cert", str, "PEM certificate chain to serve TLS with (with --tls-key)"),
    "--tls-key": ("serve.tls_key", str, "PEM private key of --tls-cert"),
    "--tls-client-ca": ("serve.tls_client_ca", str, "PEM CA callers' certificates must chain to (mTLS)"),
    "--token-file": (
        "serve.token_file",
        str,
        "file holding the bearer token callers must send (default: $RELAYRL_TOKEN_FILE)",
    ),
    "--insecure": ("serve.insecure", bool, "allow a non-loopback --host without TLS or caller check"),
}
SERVICES: dict[str, dict[str, tuple[str, type, str]]] = {
    "generator": {
        "--model": ("engine.model", str, "Hugging Face model folder"),
        "--dtype": ("engine.dtype", str, "auto, float32, bfloat16, float16"),
        "--tensor-parallel-size": ("engine.tensor_parallel_size", int, "GPUs per replica"),
        "--max-model-len": ("engine.max_model_len", int, "longest prompt + completion"),
        "--kv-cache-gib": ("engine.kv_cache_gib", float, "KV cache GiB (CPU)"),
        "--replica-id": ("replica_id", str, "name reported with every sample"),
    },
    "learner": {
        "--model": ("model", str, "Hugging Face model folder to train"),
        "--role": ("role", str, "actor (the policy), critic (value model) or reference (frozen)"),
        "--world-size": ("world_size", int, "ZeRO-3 ranks in all (nproc per node x nodes)"),
        "--dtype": ("dtype", str, "float32 or bfloat16"),
        "--lr": ("optim.lr", float, "peak learning rate"),
        "--loss": ("loss.kind", str, "grpo, drgrpo, dapo, sft"),
        "--checkpoint-dir": ("checkpoint_dir", str, "folder that checkpoint and export paths must lie in"),
    },
    "reward": {
        "--workers": ("workers", int, "scoring processes (default 2)"),
        "--timeout-seconds": ("timeout_seconds", float, "per-sample scoring limit when a request sets none"),
        "--plugin": (
            "plugins",
            list,
            "user scorer MODULE:FUNCTION (repeatable); the function's data_sources attribute lists "
            "the data sources it scores",
        ),
    },
    "coordinator": {},
    "env": {
        "--plugin": (
            "plugins",
            list,
            "user environment MODULE:CLASS (repeatable): an Env subclass, or a TRL-style class "
            "(public methods are tools, reset(**row), get_reward())",
        ),
        "--max-sessions": ("max_sessions", int, "most sessions open at once (default 1024)"),
        "--lease-seconds": (
            "lease_seconds",
            float,
            "idle time after which a session is closed (default 300)",
        ),
    },
    "gateway": {
        "--generator": ("generators", list, "generator replica HOST:PORT to sample on (repeatable)"),
        "--http-host": ("http.host", str, "address of the OpenAI-compatible API (default 127.0.0.1)"),
        "--http-port": ("http.port", int, "port of the OpenAI-compatible API (0: pick a free one)"),
        "--public-url": ("http.public_url", str, "base URL handed to agents (default: as bound)"),
        "--model-name": ("model_name", str, "model name agents ask for (default relayrl-policy)"),
    },
}
# Metavar of the repeatable (list) flags, by service.
_LIST_METAVAR = {"env": "MODULE:CLASS", "gateway": "HOST:PORT"}
# Launcher flags of the learner (torchrun rendezvous), not config fields.
_LAUNCH = {
    "--nnodes": (int, "nodes taking part (default 1)"),
    "--node-rank": (int, "this node's rank (default 0)"),
    "--master-addr": (str, "rank 0's host for the training rendezvous (default 127.0.0.1)"),
    "--master-port": (int, "rendezvous port (default: a free one, single node only)"),
}


def _config_class(service: str):
    if service == "generator":
        from relayrl.generator.config import GeneratorConfig

        return GeneratorConfig
    if service == "learner":
        from relayrl.learner.config import LearnerConfig

        return LearnerConfig
    if service == "coordinator":
        from relayrl.coordinator.config import CoordinatorServeConfig

        return CoordinatorServeConfig
    if service == "reward":
        from relayrl.reward.config import RewardConfig

        return RewardConfig
    if service == "env":
        from relayrl.env.config import EnvConfig

        return EnvConfig
    if service == "gateway":
        from relayrl.gateway.config import GatewayConfig

        return GatewayConfig
    raise SystemExit(f"relayrl serve: unknown service {service!r}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run one service (generator, ...) in the foreground")
    sub = p.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, flags in SERVICES.items():
        s = sub.add_parser(name, help=f"serve relayrl.{name}.v1")
        s.add_argument("--config", help="YAML file holding this service's config section")
        s.add_argument(
            "--set", action="append", default=[], metavar="PATH=VALUE", help="override a config field"
        )
        s.add_argument("--port-file", help="write the bound gRPC port here once serving")
        for flag, (_path, typ, helptext) in {**_COMMON, **flags}.items():
            if typ is list:
                metavar = _LIST_METAVAR.get(name, "MODULE:FUNCTION")
                s.add_argument(flag, action="append", metavar=metavar, help=helptext)
            elif typ is bool:  # None unless given, so a config file's value stands
                s.add_argument(flag, action="store_const", const=True, help=helptext)
            else:
                s.add_argument(flag, type=typ, help=helptext)
        if name == "learner":
            for flag, (typ, helptext) in _LAUNCH.items():
                s.add_argument(flag, type=typ, help=helptext)
            s.add_argument(
                "--rank-from-slurm",
                action="store_true",
                help="this process is one rank, started by srun (one task per rank): its rank from "
                "SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS, no torchrun; --master-addr and "
                "--master-port name rank 0's rendezvous",
            )
        s.set_defaults(func=run, _flags={**_COMMON, **flags})


def build_config(args: argparse.Namespace):
    overrides = []
    for flag, (path, _t, _h) in args._flags.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:  # lists as JSON: a YAML flow sequence that keeps "a:b" one string
            overrides.append(f"{path}={json.dumps(value) if isinstance(value, list) else value}")
    return cfg.load(_config_class(args.service), args.config, [*overrides, *args.set])


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
    if args.service == "generator":
        # On CPU, vLLM's in-process engine with one OpenMP thread starts in seconds and runs as
        # fast; users on GPUs keep vLLM's defaults.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        eager_without_compiler()
        from relayrl.generator.server import run as serve

        died = asyncio.run(serve(config, args.port_file))
        if died:
            raise SystemExit(f"{died}: exiting with status 1 to be restarted")
    elif args.service == "learner":
        return launch_learner(config, args)
    elif args.service == "reward":
        from relayrl.reward.server import run as serve

        asyncio.run(serve(config, args.port_file))
    elif args.service == "coordinator":
        from relayrl.coordinator.server import run as serve

        asyncio.run(serve(config, args.port_file))
    elif args.service == "env":
        from relayrl.env.server import run as serve

        asyncio.run(serve(config, args.port_file))
    elif args.service == "gateway":
        from relayrl.gateway.server import run as serve

        asyncio.run(serve(config, args.port_file))
    return 0


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

    >>> a = argparse.Namespace(master_addr="n1", master_port=29500)
    >>> slurm_rank_env(argparse.Namespace(world_size=2), a, {"SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    ...                "SLURM_NTASKS": "2"})["RANK"]
    '1'
    """
    missing = [v for v in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS") if v not in env]
    if missing:
        raise SystemExit(f"learner --rank-from-slurm: {', '.join(missing)} unset: start it with srun")
    if int(env["SLURM_NTASKS"]) != config.world_size:
        raise SystemExit(
            f"learner: srun started {env['SLURM_NTASKS']} tasks for world_size {config.world_size}"
        )
    if not args.master_addr or not args.master_port:
        raise SystemExit("learner --rank-from-slurm: --master-addr and --master-port are required")
    return {
        "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env["SLURM_LOCALID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
    }


def launch_learner(config, args: argparse.Namespace) -> int:
    """Exec torchrun with one process per local rank (``relayrl.learner.rank``), or with
    ``--rank-from-slurm`` this process as one rank srun started."""
    import socket
    import sys
    import tempfile

    if not config.model:
        raise SystemExit("learner: model (--model) is required")
    if getattr(args, "rank_from_slurm", False):
        os.environ.update(slurm_rank_env(config, args, dict(os.environ)))
        fd, path = tempfile.mkstemp(prefix="relayrl-learner-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(cfg.dump_yaml(config))
        port_file = ["--port-file", args.port_file] if args.port_file else []
        os.execv(sys.executable, [sys.executable, "-m", "relayrl.learner.rank", "--config", path, *port_file])
    nnodes = args.nnodes or 1
    if config.world_size % nnodes:
        raise SystemExit(f"learner: world_size {config.world_size} is not a multiple of --nnodes {nnodes}")
    port = args.master_port
    if port is None:
        if nnodes > 1:
            raise SystemExit("learner: --master-port is required with several nodes")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    fd, path = tempfile.mkstemp(prefix="relayrl-learner-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(cfg.dump_yaml(config))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={config.world_size // nnodes}",
        f"--nnodes={nnodes}",
        f"--node_rank={args.node_rank or 0}",
        f"--master_addr={args.master_addr or '127.0.0.1'}",
        f"--master_port={port}",
        "-m",
        "relayrl.learner.rank",
        "--config",
        path,
        *(["--port-file", args.port_file] if args.port_file else []),
    ]
    logging.getLogger(__name__).info("launching: %s", " ".join(cmd))
    os.execv(sys.executable, cmd)
