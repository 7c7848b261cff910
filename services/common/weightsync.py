"""Weight sync between the learner and generators: bucket plans, packing, a private process group.

Both ends use this module, so sender and receiver agree by construction:

* ``plan_buckets`` (pure) lays tensors out in flat uint8 buckets of a target size, each tensor
  at an aligned offset, so one broadcast moves many small tensors (one call per tensor is slow:
  the per-call latency dominates for small tensors).
* ``pack`` / ``unpack`` copy tensors into / view them out of a bucket buffer.
* ``open_group`` joins a torch.distributed process group built directly from a ``TCPStore``,
  not through ``init_process_group``: the learner's training group (and vLLM's own group inside
  a generator) stay untouched. Backend by device: NCCL on GPUs, gloo on CPU; the code path is
  the same.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# dtype name -> bytes per element. Names are torch's (``str(torch.float32)`` minus "torch.").
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}
ALIGN = 64  # byte alignment of each tensor inside a bucket (cache line; any dtype views cleanly)


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype name and shape of one tensor (what a receiver needs to view it)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Bucket:
    """Tensors sent as one flat uint8 broadcast; ``offsets[i]`` is where tensor i starts."""

    tensors: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]
    nbytes: int


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``.

    >>> aligned(0), aligned(1), aligned(64), aligned(65)
    (0, 64, 64, 128)
    """
    return -(-n // ALIGN) * ALIGN


SOLO_BYTES = 4 << 20  # tensors this large travel alone: broadcast in place, no packing copy


def plan_buckets(
    metas: Iterable[TensorMeta], bucket_bytes: int, solo_bytes: int = SOLO_BYTES
) -> list[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes``. A tensor of at least
    ``solo_bytes`` (or larger than a bucket) gets a bucket of its own: it is broadcast straight
    from its memory, and packing small tensors is where buckets pay off.

    >>> b = plan_buckets([TensorMeta("a", "float32", (10,)), TensorMeta("b", "float32", (4,)),
    ...                   TensorMeta("c", "float32", (100,)), TensorMeta("d", "float32", (2,))],
    ...                  bucket_bytes=128, solo_bytes=1000)
    >>> [([t.name for t in x.tensors], x.offsets, x.nbytes) for x in b]
    [(['a', 'b'], (0, 64), 80), (['c'], (0,), 400), (['d'], (0,), 8)]
    >>> [len(x.tensors) for x in plan_buckets([TensorMeta("a", "float32", (10,))] * 3, 1 << 20, solo_bytes=40)]
    [1, 1, 1]
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[Bucket] = []
    cur: list[TensorMeta] = []
    offs: list[int] = []
    end = 0
    for meta in metas:
        if meta.dtype not in ITEMSIZE:
            raise ValueError(f"{meta.name}: unsupported dtype {meta.dtype!r}")
        if meta.nbytes >= solo_bytes:
            if cur:
                buckets.append(Bucket(tuple(cur), tuple(offs), end))
                cur, offs, end = [], [], 0
            buckets.append(Bucket((meta,), (0,), meta.nbytes))
            continue
        start = aligned(end) if cur else 0
        if cur and start + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(cur), tuple(offs), end))
            cur, offs, start = [], [], 0
        cur.append(meta)
        offs.append(start)
        end = start + meta.nbytes
    if cur:
        buckets.append(Bucket(tuple(cur), tuple(offs), end))
    return buckets


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(
    bucket: Bucket,
    tensors: Sequence[torch.Tensor],
    device: str | torch.device = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tensors`` (same order as ``bucket.tensors``) as one flat uint8 buffer: ``out`` when given
    (a shared-memory or shared CUDA buffer of ``bucket.nbytes``), else a new buffer, or, for a
    lone contiguous tensor already on ``device``, a view of its memory (no copy)."""
    import torch

    if out is not None:
        if out.numel() != bucket.nbytes or out.dtype != torch.uint8:
            raise ValueError(
                f"out holds {out.numel()} {out.dtype} elements, the bucket {bucket.nbytes} bytes"
            )
        buf = out
    elif len(tensors) == 1:
        (t,), (meta,) = tensors, bucket.tensors
        if (
            t.is_contiguous()
            and t.device == torch.device(device)
            and tuple(t.shape) == meta.shape
            and dtype_name(t.dtype) == meta.dtype
        ):
            return t.detach().reshape(-1).view(torch.uint8)
    if out is None:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    end = 0
    for meta, off, t in zip(bucket.tensors, bucket.offsets, tensors, strict=True):
        if tuple(t.shape) != meta.shape or dtype_name(t.dtype) != meta.dtype:
            raise ValueError(
                f"{meta.name}: tensor is {dtype_name(t.dtype)}{tuple(t.shape)}, plan says {meta.dtype}{meta.shape}"
            )
        buf[end:off].zero_()  # alignment padding: zeros, so a bucket's checksum depends on its tensors only
        buf[off : off + meta.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        end = off + meta.nbytes
    buf[end:].zero_()
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor in ``buf`` (no copy): ``[(name, tensor), ...]``."""
    if buf.numel() != bucket.nbytes:
        raise ValueError(f"bucket buffer has {buf.numel()} bytes, plan says {bucket.nbytes}")
    out = []
    for meta, off in zip(bucket.tensors, bucket.offsets, strict=True):
        t = buf[off : off + meta.nbytes].view(torch_dtype(meta.dtype)).view(meta.shape)
        out.append((meta.name, t))
    return out


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or an infinity, else None. A policy
    that diverged must not reach (or be loaded by) a generator, where it would sample garbage.

    >>> import torch
    >>> non_finite([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("nan")])), ("c", torch.ones(1))])
    'b'
    >>> non_finite([("ids", torch.tensor([1, 2]))]) is None
    True
    >>> non_finite([("big", torch.full((4,), 3e38)), ("inf", torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16))])
    'inf'

    """
    import torch

    for name, t in named:
        if not t.is_floating_point():
            continue
        # One reading pass and no allocation: NaN or an infinity anywhere makes the sum
        # non-finite. Only then (or for a sum that overflowed) is each element looked at; the
        # elementwise test alone cost ~1 s per GB on one CPU core, as much as loading the weights.
        if t.dtype in (torch.float32, torch.float64):
            total = t.sum()
        elif t.dtype in (torch.float16, torch.bfloat16):
            total = t.sum(dtype=torch.float32)
        else:
            total = None  # fp8 and other exotic types: elementwise only
        if (total is None or not bool(torch.isfinite(total))) and not bool(torch.isfinite(t).all()):
            return name
    return None


def from_bytes(data: bytes, meta: TensorMeta) -> torch.Tensor:
    """A read-only view of ``data`` as the tensor ``meta`` describes (no copy)."""
    import warnings

    import torch

    with warnings.catch_warnings():  # bytes are immutable; nothing writes through this view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(torch_dtype(meta.dtype)).view(meta.shape)


def checksum(buf: torch.Tensor) -> int:
    """Order-independent integrity sum of a uint8 bucket: little-endian int64 words (a trailing
    partial word as bytes), summed modulo 2^64. About 20 ms per 400 MB on one CPU core.

    >>> import torch
    >>> checksum(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 2, 7], dtype=torch.uint8))
    10
    """
    import torch

    n8 = buf.numel() // 8 * 8
    words = int(buf[:n8].view(torch.int64).sum()) if n8 else 0  # int64 sums wrap: mod 2^64
    return (words + int(buf[n8:].sum(dtype=torch.int64))) % (1 << 64)


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


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


def open_group_with_store(
    master_addr: str,
    master_port: int,
    world_size: int,
    rank: int,
    backend: str,
    timeout_s: float = 300.0,
    group_name: str = "relayrl-weights",
):
    """``open_group``, and the group's store: the side channel ``groupwait`` uses to say that a
    push was abandoned. Returns (ProcessGroup, store)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
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


def dtype_kind(dtype: str) -> str:
    """ "float", "int" or "bool": what a value of ``dtype`` (a torch name) is.

    >>> dtype_kind("bfloat16"), dtype_kind("int64"), dtype_kind("uint8"), dtype_kind("bool")
    ('float', 'int', 'int', 'bool')
    """
    if dtype == "bool":
        return "bool"
    return "int" if dtype.startswith(("int", "uint")) else "float"


def safetensors_kind(dtype: str) -> str:
    """``dtype_kind`` of a safetensors header's dtype ("F32", "BF16", "I64", "U8", "BOOL", ...).

    >>> safetensors_kind("BF16"), safetensors_kind("F8_E4M3"), safetensors_kind("I64"), safetensors_kind("BOOL")
    ('float', 'float', 'int', 'bool')
    """
    if dtype == "BOOL":
        return "bool"
    return "int" if dtype.startswith(("I", "U")) else "float"


def check_plan(
    metas: Sequence[TensorMeta],
    expected: dict[str, tuple[int, ...]],
    optional: set[str],
    kinds: dict[str, str] | None = None,
) -> list[str]:
    """Problems with a plan against a model's checkpoint tensors (name -> shape, and name ->
    ``dtype_kind`` when ``kinds`` is given).

    Every expected tensor must appear once with its shape; names in ``optional`` (e.g. a tied
    ``lm_head.weight``) may appear or not; nothing else may. A tensor's dtype may differ from the
    checkpoint's in precision (bfloat16 for float32: the engine converts), not in kind: integers
    sent for float weights would be converted silently into a model nobody trained.

    >>> check_plan([TensorMeta("a", "float32", (2,)), TensorMeta("x", "float32", (1,))],
    ...            {"a": (3,), "b": (1,)}, set())
    ["a: shape (2,) does not match the model's (3,)", 'x: not a tensor of this model', 'missing tensors: b']
    >>> check_plan([TensorMeta("a", "int64", (3,))], {"a": (3,)}, set(), {"a": "float"})
    ['a: dtype int64 where the model holds float values']
    """
    problems = []
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            problems.append(f"{m.name}: appears twice")
        seen.add(m.name)
        if m.dtype not in ITEMSIZE:
            problems.append(f"{m.name}: unsupported dtype {m.dtype!r}")
        elif kinds and m.name in kinds and dtype_kind(m.dtype) != kinds[m.name]:
            problems.append(f"{m.name}: dtype {m.dtype} where the model holds {kinds[m.name]} values")
        if m.name in expected:
            if tuple(m.shape) != tuple(expected[m.name]):
                problems.append(
                    f"{m.name}: shape {tuple(m.shape)} does not match the model's {tuple(expected[m.name])}"
                )
        elif m.name not in optional:
            problems.append(f"{m.name}: not a tensor of this model")
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        problems.append(f"missing tensors: {shown}")
    return problems
