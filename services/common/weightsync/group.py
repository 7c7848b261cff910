"""A private torch.distributed process group for the group transports (gloo, NCCL).

``open_group`` joins a group built directly from a ``TCPStore``, not through
``init_process_group``: the learner's training group (and vLLM's own group inside a generator)
stay untouched. Rank 0 (the learner) hosts the store. Where gloo binds is chosen here too
(``gloo_device_args``): multi-homed hosts bind the wrong interface by default.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def open_group(
    master_addr: str,
    master_port: int,
    world_size: int,
    rank: int,
    backend: str,
    timeout_s: float = 300.0,
    group_name: str = "relayrl-weights",
):
    """Join a private process group (rank 0 hosts the TCPStore). Returns the ProcessGroup."""
    return open_group_with_store(master_addr, master_port, world_size, rank, backend, timeout_s, group_name)[
        0
    ]


def master_store(master_addr: str, world_size: int, timeout_s: float = 300.0):
    """Rank 0's store for a new group, listening on a port the kernel picked (``.port``): the
    port is known only once it is bound, so no other socket can take it between a choice and
    the bind (a port found free, closed, and bound again later was taken meanwhile under load:
    EADDRINUSE)."""
    import torch.distributed as dist

    return dist.TCPStore(
        master_addr,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def open_group_with_store(
    master_addr: str,
    master_port: int,
    world_size: int,
    rank: int,
    backend: str,
    timeout_s: float = 300.0,
    group_name: str = "relayrl-weights",
    store=None,
):
    """``open_group``, and the group's store: the side channel ``groupwait`` uses to say that a
    push was abandoned. Returns (ProcessGroup, store). ``store``: rank 0's, already listening
    (``master_store``); otherwise one is made (rank 0) or joined (the others)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=(rank == 0),
            timeout=timeout,
            wait_for_workers=False,
        )
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [gloo_device(master_addr, master_port)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts), store
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts), store
    raise ValueError(f"unknown weight-sync backend {backend!r} (gloo or nccl)")


def gloo_device(master_addr: str, master_port: int):
    """The gloo device for a group whose rank 0 is at ``master_addr`` (see ``gloo_device_args``)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo.create_device(**gloo_device_args(master_addr, master_port))


TRAINING_IFNAME_VAR = "RELAYRL_TRAINING_GLOO_IFNAME"
"""Set by a learner rank beside the GLOO_SOCKET_IFNAME it chose for its training group."""


def gloo_device_args(master_addr: str, master_port: int) -> dict[str, str]:
    """Where a gloo device binds, for a group whose rank 0 is at ``master_addr``.

    Gloo's default device binds the address this host's *name* resolves to, which on multi-homed
    hosts (pods, network namespaces, nodes with several NICs) is often not the interface that
    reaches the other members: peers then connect to an address nobody listens on and the group
    hangs until its timeout. Bind instead the local address the kernel routes toward rank 0.
    $GLOO_SOCKET_IFNAME still wins when the operator set it, but not when a learner rank set it
    for its own training group: that interface faces the learner's other ranks (``lo`` on one
    node), not the generators, and a weight-sync group bound there cannot be reached from
    another host or container.

    >>> import os; os.environ.pop("GLOO_SOCKET_IFNAME", None) and None
    >>> gloo_device_args("127.0.0.1", 9)
    {'hostname': '127.0.0.1'}
    >>> os.environ["GLOO_SOCKET_IFNAME"] = "eth1"; gloo_device_args("127.0.0.1", 9)
    {'interface': 'eth1'}
    >>> os.environ[TRAINING_IFNAME_VAR] = "eth1"; gloo_device_args("127.0.0.1", 9)
    {'hostname': '127.0.0.1'}
    >>> del os.environ["GLOO_SOCKET_IFNAME"], os.environ[TRAINING_IFNAME_VAR]
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname and ifname != os.environ.get(TRAINING_IFNAME_VAR):
        return {"interface": ifname.split(",")[0]}
    return {"hostname": local_address_toward(master_addr, master_port)}


def local_address_toward(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent: a UDP connect only
    asks the kernel for the route).

    >>> local_address_toward("127.0.0.1", 9)
    '127.0.0.1'
    """
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def interface_toward(host: str, port: int) -> str | None:
    """Name of the network interface holding ``local_address_toward(host, port)``, if any.

    >>> interface_toward("127.0.0.1", 9)
    'lo'
    """
    import psutil

    local = local_address_toward(host, port)
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addrs):
            return name
    return None


def broadcast(pg, tensor: torch.Tensor, root: int = 0) -> None:
    """Blocking broadcast of ``tensor`` from ``root`` over ``pg`` (in place on receivers)."""
    pg.broadcast(tensor, root).wait()
