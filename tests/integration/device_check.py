"""Run under torchrun (2 ranks, CPU) by test_learner_service: train, push, save, load and export,
with every collective refusing a tensor that relayrl created without saying its device.

Why: on GPUs the training group is NCCL, which takes CUDA tensors only; a tensor made with
``torch.zeros(n)`` lands on the CPU and the collective fails ("No backend type associated with
device type cpu", the first TrainStep on an H100 did). On this CPU machine every tensor is on the
CPU, so the device itself cannot tell. What can: every tensor relayrl hands to a collective of
the training or weight-sync group must have been made with an explicit device (the trainer's, or
the group's). A torch function mode marks tensors that relayrl code creates without a device, and
the collectives below refuse marked ones, naming the caller. The control channel is gloo by
design (CPU tensors are right there) and is exempt.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import weakref
from pathlib import Path

import relayrl  # noqa: F401
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.rand,
    torch.randn, torch.randint, torch.as_tensor, torch.frombuffer, torch.eye, torch.linspace,
}  # fmt: skip
_implicit: dict[int, str] = {}  # id of a live tensor made without a device -> where (dropped when it dies)


def _relayrl_caller() -> str | None:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith("relayrl."):
            return f"{name}:{f.f_lineno}"
        if not name.startswith(("torch", "__main__")):
            return None
        f = f.f_back
    return None


class MarkImplicitDevice(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES and "device" not in kwargs and isinstance(out, torch.Tensor):
            where = _relayrl_caller()
            if where is not None:
                _implicit[id(out)] = where
                weakref.finalize(out, _implicit.pop, id(out), None)
        return out


def _check(tensors, op: str) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) in _implicit:
            raise RuntimeError(
                f"{op}: a tensor made at {_implicit[id(t)]} without an explicit device reached a "
                "collective (on GPUs: 'No backend type associated with device type cpu')"
            )


def strict(fn, op: str, exempt_group=None):
    def wrapped(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 and not isinstance(args[1], int) else None)
        if exempt_group is None or group is not exempt_group():
            _check(tensor if isinstance(tensor, list | tuple) else [tensor], op)
        return fn(tensor, *args, **kwargs)

    return wrapped


def receiver(addr: str, port: int, plans: list, backend: str, out: mp.Queue) -> None:
    """A stand-in generator worker: joins the weight-sync group as rank 1, receives each push
    (over NCCL: on the last GPU, which the learner's rank 0 does not use)."""
    from relayrl.common.weightsync.buckets import checksum
    from relayrl.common.weightsync.group import broadcast, open_group

    device = torch.device("cuda", torch.cuda.device_count() - 1) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    pg = open_group(addr, port, 2, 1, backend, timeout_s=120)
    for nbytes in plans:
        sums = []
        for n in nbytes:
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            broadcast(pg, buf)
            sums.append(checksum(buf))
        out.put(sums)


def main(model: str, backend: str) -> None:
    from relayrl.common.weightsync.group import open_group
    from relayrl.common.weightsync.plan import plan_buckets
    from relayrl.learner.config import LearnerConfig
    from relayrl.learner.control import Control
    from relayrl.learner.core import LearnerCore
    from relayrl.learner.push import Sinks, WeightGroup
    from relayrl.learner.rank import init_distributed
    from relayrl.learner.trainer import Trainer
    from relayrl.learner.v1 import learner_pb2 as lp

    init_distributed()
    rank = dist.get_rank()
    trainer = Trainer(LearnerConfig(model=model, world_size=dist.get_world_size(), micro_batch_tokens=64))
    core = LearnerCore(trainer, Control())
    control_group = weakref.ref(core.control.group)
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "reduce", "gather", "scatter"):  # fmt: skip
        setattr(dist, name, strict(getattr(dist, name), name, exempt_group=control_group))
    gloo_broadcast = dist.ProcessGroupGloo.broadcast

    def pg_broadcast(self, tensors, *args, **kwargs):  # the weight-sync group's own method
        _check(tensors if isinstance(tensors, list | tuple) else [tensors], "weight-sync broadcast")
        return gloo_broadcast(self, tensors, *args, **kwargs)

    dist.ProcessGroupGloo.broadcast = pg_broadcast
    if backend == "nccl":
        nccl_broadcast = dist.ProcessGroupNCCL.broadcast

        def nccl_pg_broadcast(self, tensors, *args, **kwargs):
            _check(tensors if isinstance(tensors, list | tuple) else [tensors], "weight-sync broadcast")
            return nccl_broadcast(self, tensors, *args, **kwargs)

        dist.ProcessGroupNCCL.broadcast = nccl_pg_broadcast

    req = lp.TrainStepRequest(
        step=1,
        samples=[
            lp.TrainSample(prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9, 10], generator_logprobs=[-1.0] * 3, advantage=a)
            for a in (1.0, -1.0, 0.5, -0.5)
        ],
    )  # fmt: skip
    with MarkImplicitDevice(), tempfile.TemporaryDirectory() as tmp:
        out = Path(os.environ.get("RELAYRL_DEVICE_CHECK_DIR", tmp))
        if rank == 0:
            m = core.train(req, 0)
            assert m["applied"], m
            seqs = [lp.TokenSequence(prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids)
                    for s in req.samples]  # fmt: skip
            scored = core.score(seqs, "logprobs")  # ComputeLogprobs: each rank's share, one all-reduce
            assert [len(x) for x in scored] == [3] * 4 and all(v <= 0 for x in scored for v in x), scored
            plan = plan_buckets(trainer.param_metas("float32"), 64 << 10)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            got: mp.Queue = mp.get_context("spawn").Queue()
            plans = [[b.nbytes for b in plan]]
            proc = mp.get_context("spawn").Process(
                target=receiver, args=("127.0.0.1", port, plans, backend, got)
            )
            proc.start()
            group = WeightGroup(open_group("127.0.0.1", port, 2, 0, backend, timeout_s=120), {"r": 1}, 2)
            sent, sums = core.push(plan, Sinks(groups=[group]))
            assert got.get(timeout=120) == sums and sent == sum(b.nbytes for b in plan)
            proc.join(30)
            core.save(str(out / "ckpt"), "t1", "{}")
            meta = core.load(str(out / "ckpt"), "t1")
            assert meta["step"] == 1, meta
            core.export(str(out / "export"), 64 << 10)
            assert (out / "export" / "model.safetensors").exists()
            core.stop()
        else:
            core.follow()
    print(
        f"rank {rank}: train, score, push, save, load, export: every collective tensor had an explicit device",
        flush=True,
    )
    dist.barrier(group=core.control.group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gloo")
