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


def add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("launch", help="run an experiment with its services on a cluster manager")
    sub = p.add_subparsers(dest="backend", required=True, metavar="BACKEND")
    r = sub.add_parser(
        "ray",
        help="services as Ray actors in placement groups (ray.address: a cluster; none: a private one)",
    )
    r.add_argument("experiment", nargs="?", help="experiment YAML (not needed with --resume)")
    r.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override a config field")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    r.add_argument("--address", help="Ray cluster to join (the same as --set ray.address=...)")
    r.set_defaults(func=launch_ray, command="launch ray")
    s = sub.add_parser(
        "slurm",
        help="services as steps of the Slurm job this runs in (deploy/slurm/relayrl.sbatch); a "
        "requeued job resumes its run",
    )
    s.add_argument("experiment", nargs="?", help="experiment YAML (not needed with --resume)")
    s.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override a config field")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    s.set_defaults(func=launch_slurm, command="launch slurm")


def _experiment(args: argparse.Namespace, overrides: list[str]):
    """The config to run, and the run folder to resume (or None)."""
    from relayrl.coordinator.derive import load_experiment

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise SystemExit(
                f"relayrl {args.command} --resume: {run_dir} has no config.yaml (not a run folder)"
            )
        if not (run_dir / "checkpoints" / "coordinator.json").exists():
            raise SystemExit(f"relayrl {args.command} --resume: {run_dir} has no checkpoint yet")
        return load_experiment(run_dir / "config.yaml", overrides), run_dir
    if not args.experiment:
        raise SystemExit(f"relayrl {args.command}: give an experiment file, or --resume RUN_DIR")
    return load_experiment(args.experiment, overrides), None


def run(args: argparse.Namespace) -> int:
    from relayrl.coordinator.run import run as run_experiment

    cfg, resume_dir = _experiment(args, args.set)
    run_experiment(cfg, resume_dir=resume_dir)
    return 0


def ray_overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` items, then ``--address`` as ``ray.address`` (quoted: ``1:2`` is a number to YAML)."""
    import json

    return [*args.set, *([f"ray.address={json.dumps(args.address)}"] if args.address else [])]


def launch_ray(args: argparse.Namespace) -> int:
    cfg, resume_dir = _experiment(args, ray_overrides(args))
    from relayrl.coordinator.run import launch_ray as launch

    launch(cfg, resume_dir=resume_dir)
    return 0


def launch_slurm(args: argparse.Namespace) -> int:
    cfg, resume_dir = _experiment(args, args.set)
    from relayrl.coordinator.run import launch_slurm as launch

    launch(cfg, resume_dir=resume_dir)  # a requeued job resumes its own run
    return 0


def _client_parser(sub, name: str, helptext: str, run_id: str | None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=helptext)
    if run_id == "required":
        p.add_argument("run_id", help="the run's id (its folder name)")
    elif run_id == "optional":
        p.add_argument("run_id", nargs="?", help="the run's id (default: every run)")
    p.add_argument(
        "--coordinator", help="host:port (default: $RELAYRL_COORDINATOR, else <runs-dir>/coordinator.addr)"
    )
    p.add_argument("--runs-dir", default="runs", help="where `relayrl run` records its coordinator address")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline of the call in seconds")
    p.add_argument("--tls-ca", metavar="PEM", help="CA that signed the coordinator's certificate (TLS)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    p.add_argument(
        "--token-file", metavar="FILE", help="file holding the bearer token (default: $RELAYRL_TOKEN_FILE)"
    )
    return p


def add_client_parsers(subparsers: argparse._SubParsersAction) -> None:
    _client_parser(
        subparsers, "status", "status of a run (or of all runs) on a coordinator", "optional"
    ).set_defaults(func=status)
    _client_parser(subparsers, "list", "runs known to a coordinator", None).set_defaults(func=status)
    _client_parser(
        subparsers, "stop", "stop a run after its current step (it checkpoints first)", "required"
    ).set_defaults(func=stop)


def _stub(args: argparse.Namespace):
    import os

    from relayrl.common import security
    from relayrl.common.serving import ClientSecurity
    from relayrl.coordinator.v1 import coordinator_pb2_grpc as cpg

    addr = args.coordinator or os.environ.get("RELAYRL_COORDINATOR")
    if not addr:
        f = Path(args.runs_dir) / "coordinator.addr"
        if not f.exists():
            raise SystemExit(
                f"relayrl {args.command}: no coordinator address (--coordinator, $RELAYRL_COORDINATOR "
                f"or {f}); is a run going?"
            )
        addr = f.read_text().strip()
    try:
        sec = ClientSecurity(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token_file=args.token_file)
        channel = security.sync_channel(addr, **security.client_settings(sec))
    except ValueError as e:  # pydantic's ValidationError and SecurityError both are
        raise SystemExit(f"relayrl {args.command}: {e}") from None
    return cpg.CoordinatorServiceStub(channel), addr


def _show(exps) -> None:
    from relayrl.coordinator.v1 import coordinator_pb2 as cp

    for e in exps:
        state = cp.ExperimentState.Name(e.state).removeprefix("EXPERIMENT_STATE_").lower()
        m = e.last_metrics
        extra = "  ".join(f"{k} {m[k]:.3f}" for k in ("reward_mean", "eval_accuracy", "kl") if k in m)
        print(
            f"{e.run_id}  {state}  step {e.step}/{e.total_steps}  version {e.policy_version}  {extra}  {e.run_dir}"
        )
        if e.message:
            print(f"  {e.message}")


def _call(args, fn):
    import grpc

    stub, addr = _stub(args)
    try:
        return fn(stub)
    except grpc.RpcError as e:
        raise SystemExit(f"relayrl {args.command}: {addr}: {e.code().name}: {e.details()}") from None


def status(args: argparse.Namespace) -> int:
    from relayrl.coordinator.v1 import coordinator_pb2 as cp

    if getattr(args, "run_id", None):
        resp = _call(
            args,
            lambda s: s.GetExperimentStatus(
                cp.GetExperimentStatusRequest(run_id=args.run_id), timeout=args.timeout
            ),
        )
        _show([resp.experiment])
    else:
        resp = _call(args, lambda s: s.ListExperiments(cp.ListExperimentsRequest(), timeout=args.timeout))
        _show(resp.experiments)
    return 0


def stop(args: argparse.Namespace) -> int:
    from relayrl.coordinator.v1 import coordinator_pb2 as cp

    resp = _call(
        args,
        lambda s: s.StopExperiment(
            cp.StopExperimentRequest(run_id=args.run_id, checkpoint=True), timeout=args.timeout
        ),
    )
    _show([resp.experiment])
    return 0
