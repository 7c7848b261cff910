"""Which way weights travel from the learner to one generator replica, from where both run.

=================================================  =========  =================================
where the replica runs                             transport  why
=================================================  =========  =================================
every worker on the learner's GPU                  ipc        NCCL refuses two ranks on one GPU;
                                                              CUDA IPC hands over the buffers
other GPUs (this host or another)                  nccl       GPU to GPU, NVLink where present
this host, CPU (or GPUs shared only in part)       shm        one copy through shared memory
another host, CPU                                  gloo       a broadcast over TCP
=================================================  =========  =================================

"This host" means the same boot and IPC namespace (``relayrl.common.placement.host_id``): two
processes that can share memory. The learner checks the choice when the replica registers (the
replica opens a probe over it), so a transport that cannot work is refused there with the
reason; ``weight_sync_transport`` forces one instead of the table.
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("ipc", "shm", "nccl", "gloo")
GROUP_BACKEND = {"nccl": "nccl", "gloo": "gloo"}
"""Transports that broadcast over a torch.distributed group, and its backend."""


@dataclass(frozen=True)
class Place:
    """Where a process runs: ``host_id``, ``device`` ("cuda" or "cpu"), the UUIDs of its GPUs."""

    host_id: str
    device: str
    gpu_uuids: tuple[str, ...] = ()


def choose(learner: Place, replica: Place, forced: str = "auto") -> str:
    """The transport for ``replica`` (``forced`` when not "auto").

    >>> cpu, gpu0 = Place("h1", "cpu"), Place("h1", "cuda", ("GPU-0",))
    >>> choose(cpu, Place("h1", "cpu")), choose(cpu, Place("h2", "cpu")), choose(cpu, Place("h2", "cuda", ("GPU-9",)))
    ('shm', 'gloo', 'gloo')
    >>> choose(gpu0, Place("h1", "cuda", ("GPU-0",))), choose(gpu0, Place("h1", "cuda", ("GPU-1",)))
    ('ipc', 'nccl')
    >>> choose(gpu0, Place("h2", "cuda", ("GPU-0",))), choose(gpu0, Place("h1", "cuda", ("GPU-0", "GPU-1")))
    ('nccl', 'shm')
    >>> choose(gpu0, Place("h1", "cpu")), choose(gpu0, Place("h2", "cpu")), choose(cpu, Place("h1", "cpu"), "gloo")
    ('shm', 'gloo', 'gloo')
    """
    if forced != "auto":
        return forced
    same_host = learner.host_id == replica.host_id
    if learner.device == "cuda" and replica.device == "cuda":
        shared = set(replica.gpu_uuids) & set(learner.gpu_uuids)
        if not shared or not same_host:  # a UUID is global: equal ones on two hosts cannot be
            return "nccl"
        if shared == set(replica.gpu_uuids):
            return "ipc"
        return "shm"  # some workers on the learner's GPU, some not: NCCL would see a GPU twice
    return "shm" if same_host else "gloo"
