"""One learner rank (started by torchrun): build the trainer (its engine: plain at one rank,
DeepSpeed ZeRO across ranks); rank 0 serves gRPC, the others follow rank 0's commands. ``relayrl serve learner`` launches these."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from relayrl.common import config as cfg_mod
from relayrl.common import logcontext
from relayrl.common.lifeline import exit_with_parent
from relayrl.learner.config import LearnerConfig

logger = logging.getLogger(__name__)


def init_distributed(with_deepspeed: bool = True) -> str:
    """Join the training group (torchrun's environment); ``with_deepspeed``: through DeepSpeed's
    communication layer, which its engines need. A one-rank plain engine needs neither it nor
    the memory its import takes."""
    import torch
    from relayrl.learner import rendezvous

    rendezvous.join()  # with a rendezvous file: rank 0 publishes its port, the others read it
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        # DeepSpeed builds a shared-memory all-reduce op for CPU inference on first init
        # (~80 s of C++ compile); training never uses it.
        import importlib

        # By sys.modules, not attribute access: deepspeed.comm's `torch` attribute is torch itself.
        if with_deepspeed:
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        # Nothing a CPU rank runs is compiled, yet DeepSpeed's import decorates its Muon
        # optimizer with torch.compile, which loads inductor (~0.8 CPU-s at every rank start).
        # Read by torch.compile when it is called, so setting it here, before that import, works.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        backend = "gloo"
        # Gloo binds the address the host name resolves to unless told an interface: across
        # nodes (pods, namespaces, several NICs) that is often not the one that reaches rank 0,
        # and the training group hangs at init. Name the interface routed toward MASTER_ADDR.
        if "GLOO_SOCKET_IFNAME" not in os.environ and "MASTER_ADDR" in os.environ:
            from relayrl.common.weightsync.group import TRAINING_IFNAME_VAR, interface_toward

            ifname = interface_toward(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")))
            if ifname:
                # Marked as ours, so the weight-sync group does not bind it too (weightsync/group.py).
                os.environ["GLOO_SOCKET_IFNAME"] = os.environ[TRAINING_IFNAME_VAR] = ifname
    if with_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    else:
        torch.distributed.init_process_group(backend=backend)
    return backend


def exit_now(code: int, reason: str) -> None:
    """Exit at once, logs flushed: past a broken collective, a normal exit can wait for ever (on
    gloo's pending work, or on a worker thread stuck in a collective)."""
    logger.error("%s; exiting with status %d", reason, code)
    logging.shutdown()
    os._exit(code)


async def serve(core, cfg: LearnerConfig, backend: str, port_file: str | None, heartbeat) -> None:
    from relayrl.common.grpc_server import announce_and_serve, create_server, start, start_metrics_server
    from relayrl.learner import lora
    from relayrl.learner.servicer import LearnerServicer
    from relayrl.learner.sync import WeightSync
    from relayrl.learner.v1 import learner_pb2

    host = cfg.weight_sync_host or (
        cfg.serve.host if cfg.serve.host not in ("0.0.0.0", "::") else socket.gethostname()
    )
    sync = WeightSync(
        host,
        str(core.trainer.device),
        cfg.dtype,
        cfg.weight_sync_timeout_seconds,
        cfg.rpc_deadline_seconds,
        core.trainer.param_metas,
        cfg.security,
        transport=cfg.weight_sync_transport,
        adapter=lora.spec(cfg.lora) if cfg.lora is not None else None,
    )
    servicer = LearnerServicer(
        core,
        sync,
        int(cfg.bucket_mb * (1 << 20)),
        cfg.loss.max_tokens_normaliser or 0,
        checkpoint_dir=cfg.checkpoint_dir,
    )
    handle = create_server(servicer, learner_pb2.DESCRIPTOR.services_by_name["LearnerService"], cfg.serve)
    servicer.on_broken = lambda: asyncio.ensure_future(handle.set_ready(False))

    async def release_followers() -> None:
        if servicer.broken is None:  # ranks in step: each returns from follow() and exits
            await asyncio.to_thread(core.stop, cfg.heartbeat_timeout_seconds)
        await asyncio.to_thread(heartbeat.stop)

    handle.on_shutdown.append(release_followers)
    loop = asyncio.get_running_loop()
    lost: asyncio.Future[str] = loop.create_future()
    heartbeat.on_lost = lambda reason: loop.call_soon_threadsafe(
        lambda: lost.done() or lost.set_result(f"learner: {reason}")
    )

    async def free_staging() -> None:  # the shared-memory segment must not outlive the learner
        sync.close()

    handle.on_shutdown.append(free_staging)
    await start(handle, ready=True)
    metrics_port = start_metrics_server(cfg.serve.metrics_port, cfg.serve.host)
    logger.info(
        "learner rank 0 serving on %s:%d (world %d, metrics port %s)",
        cfg.serve.host,
        handle.port,
        core.trainer.world_size,
        metrics_port,
    )
    reason = await announce_and_serve(
        handle, "learner", cfg.serve.host, cfg.serve.grace_seconds, port_file, fatal=lost
    )
    # Other ranks out of reach, or out of step: a worker thread may be stuck in a collective and
    # nothing can end cleanly; exit for the supervisor to restart every rank.
    if why := reason or core.control.broken or servicer.broken:
        exit_now(1, why)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="relayrl.learner.rank")
    ap.add_argument("--config", required=True, help="resolved learner config (YAML)")
    ap.add_argument("--port-file")
    args = ap.parse_args(argv)
    exit_with_parent()  # a rank started by a Ray actor ends with it (under torchrun: no-op)
    logcontext.configure(logging.INFO)
    cfg = cfg_mod.load(LearnerConfig, args.config)
    from relayrl.learner.dsconfig import zero_stage

    backend = init_distributed(with_deepspeed=zero_stage(cfg) > 0 or zero_stage(cfg, frozen=True) > 0)
    import torch.distributed as dist
    from relayrl.learner.control import Control, Heartbeat
    from relayrl.learner.core import LearnerCore
    from relayrl.learner.trainer import Trainer

    trainer = Trainer(cfg)
    core = LearnerCore(trainer, Control())
    # Rank 0's reaction to a lost follower is set by serve(); a follower can only exit.
    heartbeat = Heartbeat(cfg.heartbeat_timeout_seconds, lambda reason: exit_now(1, reason)).start()
    if dist.get_rank() == 0:
        asyncio.run(serve(core, cfg, backend, args.port_file, heartbeat))
    else:
        if cfg.serve.term_linger_seconds > 0:
            # Slurm signals every process of a job at once: rank 0 lingers to answer the last
            # checkpoint, which needs this rank too. Rank 0's stop (or its silence) ends it.
            signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM: this rank ends with rank 0"))
        try:
            core.follow()
        except Exception as e:  # rank 0 went away mid-command, or a collective failed
            logger.exception("learner rank %d: following rank 0 failed", dist.get_rank())
            exit_now(1, f"rank {dist.get_rank()}: {type(e).__name__}: {e}")
        heartbeat.stop()  # rank 0's last beat follows its stop command
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
