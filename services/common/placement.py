"""Where a process runs, as far as moving weights between two processes is concerned: its host
and IPC namespace (two processes that can share memory report the same ``host_id``), its device,
and the UUID of its GPU. The learner compares its own with each generator's to choose a weight
transport (``relayrl.common.weightsync.transports``)."""

from __future__ import annotations

import os
from functools import cache


@cache
def host_id() -> str:
    """The kernel's boot id and this process's IPC namespace: equal exactly for processes of one
    machine that can share POSIX shared memory (containers too, when they share an IPC
    namespace; compose ``ipc: shareable`` / ``service:NAME``).

    >>> host_id() == host_id() and "/" in host_id()
    True
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        import socket

        boot = socket.gethostname()
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = "ipc:?"
    return f"{boot}/{ipc}"


def gpu_uuid(device_index: int) -> str:
    """The UUID of a CUDA device as this process numbers it ("" without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(device_index).uuid)
