"""The bytes of a bucket: packing tensors into one flat uint8 buffer, viewing them out of it,
its checksum, and the check that no weight is NaN or infinite. Both ends use these, so what the
learner packs is what a generator unpacks, and both compute the same checksum.

A push is made to cost what its bytes cost, not what its buckets and tensors count (measured
on an H200: 98 buckets of 0.99 GB over IPC took 41 times a device copy when each bucket was
packed tensor by tensor and its checksum read back before the next):

* ``Staging``: every bucket of a plan in one allocation, a view per bucket; a bucket is filled in
  one batched copy, with no zeroing per tensor (the padding is zeroed once, when it is made).
* ``Sums``: each bucket's checksum is computed where the bucket is (a GPU's stream, or the CPU)
  and kept there; the values are read back once, at the end (``read_checksums``: the only
  place a checksum leaves its device, so a bench or a test counts the reads there). Both ends
  compute it so; its meaning (``checksum``) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from relayrl.common.weightsync.plan import Bucket, TensorMeta, layout

if TYPE_CHECKING:
    import torch


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

    floats = [(name, t) for name, t in named if t.is_floating_point()]
    # One reading pass per tensor and no allocation of its size: NaN or an infinity anywhere
    # makes the sum non-finite. The sums of all of them are judged together, one value read back
    # (on a GPU, one wait for the device instead of one per tensor); only when that finds
    # something (or a sum overflowed) is each tensor looked at, element by element. The
    # elementwise test alone cost ~1 s per GB on one CPU core, as much as loading the weights.
    totals = [_float_sum(t) for _, t in floats]
    known = [s for s in totals if s is not None]
    all_finite = not known or bool(torch.isfinite(torch.stack([s.to(known[0].device) for s in known])).all())
    for (name, t), total in zip(floats, totals, strict=True):
        if total is not None and all_finite:
            continue
        if (total is None or not bool(torch.isfinite(total))) and not bool(torch.isfinite(t).all()):
            return name
    return None


def _float_sum(t: torch.Tensor) -> torch.Tensor | None:
    """The sum of a float tensor as a float64 scalar where it is (None for fp8 and other exotic
    types, which are checked elementwise)."""
    import torch

    if t.dtype in (torch.float32, torch.float64):
        return t.sum().double()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.sum(dtype=torch.float32).double()
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
    partial word as bytes), summed modulo 2^64. About 20 ms per 400 MB on one CPU core. One
    value read back: a push keeps its buckets' sums in ``Sums`` instead.

    >>> import torch
    >>> checksum(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 2, 7], dtype=torch.uint8))
    10
    """
    sums = Sums()
    sums.add(buf)
    return sums.read()[0]


def device_checksum(buf: torch.Tensor) -> torch.Tensor:
    """``checksum`` of ``buf`` as a 0-d int64 tensor on ``buf``'s device (the value modulo 2^64,
    as a signed int64), computed without waiting for it: a kernel queued on the current stream."""
    import torch

    if buf.storage_offset() % 8:  # an int64 view needs aligned memory (a lone tensor's own view)
        buf = buf.clone()
    n8 = buf.numel() // 8 * 8
    if n8:
        total = buf[:n8].view(torch.int64).sum()  # int64 sums wrap: mod 2^64
    else:
        total = torch.zeros((), dtype=torch.int64, device=buf.device)
    if n8 != buf.numel():
        total = total + buf[n8:].sum(dtype=torch.int64)
    return total


def read_checksums(values: torch.Tensor) -> list[int]:
    """Checksums held in a 1-D int64 tensor, as Python ints modulo 2^64: the one place their
    values leave the device (one wait for it, one small transfer).

    >>> import torch
    >>> read_checksums(torch.tensor([-1, 5]))
    [18446744073709551615, 5]
    """
    return [v % (1 << 64) for v in values.tolist()]


class Sums:
    """The checksums of a push's buckets, in order: each computed where its bucket is
    (``device_checksum``) or given (``add_known``: one a sender wrote, read on the CPU), and
    read back together, once (``read``). ``value(i)`` reads one of them now, for a reader that
    needs it before the push ends (a shared-memory bucket's ready mark carries it).

    >>> import torch
    >>> s = Sums(); s.add(torch.tensor([3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)); s.add_known(7)
    >>> s.add(torch.tensor([1, 2], dtype=torch.uint8)); len(s), s.read()
    (3, [3, 7, 3])
    """

    def __init__(self) -> None:
        self._items: list = []  # 0-d int64 tensors not read yet, and ints

    def __len__(self) -> int:
        return len(self._items)

    def add(self, buf: torch.Tensor) -> None:
        self._items.append(device_checksum(buf))

    def add_known(self, value: int) -> None:
        self._items.append(int(value))

    def value(self, i: int) -> int:
        item = self._items[i]
        if not isinstance(item, int):
            item = self._items[i] = read_checksums(item.reshape(1))[0]
        return item

    def read(self) -> list[int]:
        import torch

        pending = [x for x in self._items if not isinstance(x, int)]
        if pending:
            device = pending[0].device
            got = iter(read_checksums(torch.stack([x.to(device) for x in pending])))
            self._items = [x if isinstance(x, int) else next(got) for x in self._items]
        return list(self._items)


class Staging:
    """Every bucket of a plan in one flat uint8 buffer, bucket i at ``offsets[i]``
    (``plan.layout``: aligned, so each bucket's int64 checksum view is too): one allocation (or the buffer given: a shared-memory mapping), a view per
    bucket (``views``) and, per tensor, a view of its bytes in the plan's dtype and shape, made
    once. ``fill`` copies a bucket's tensors in one batched call and writes nothing else: the
    alignment padding between tensors is zeroed here, once, so a bucket's checksum depends on
    its tensors only.

    >>> import torch
    >>> from relayrl.common.weightsync.plan import plan_buckets
    >>> plan = plan_buckets([TensorMeta("a", "float32", (3,)), TensorMeta("b", "int64", (2,))], 1 << 10)
    >>> st = Staging(plan)
    >>> buf = st.fill(0, [torch.tensor([1.5, -2.0, 3.25]), torch.tensor([7, 9])])
    >>> bool(torch.equal(buf, pack(plan[0], [torch.tensor([1.5, -2.0, 3.25]), torch.tensor([7, 9])])))
    True
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        buf: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
        start: int = 0,
    ):
        import torch

        self.buckets = list(buckets)
        self.offsets, self.nbytes = layout(self.buckets, start)
        if buf is None:
            buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        elif buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(f"staging for this plan takes a flat uint8 buffer of {self.nbytes} bytes")
        else:
            for b, o in zip(self.buckets, self.offsets, strict=True):
                end = 0
                for meta, off in zip(b.tensors, b.offsets, strict=True):
                    if off > end:
                        buf[o + end : o + off].zero_()
                    end = off + meta.nbytes
        self.buf = buf
        self.views = [buf[o : o + b.nbytes] for b, o in zip(self.buckets, self.offsets, strict=True)]
        self._typed: list[list[torch.Tensor] | None] = [None] * len(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def typed(self, i: int) -> list[torch.Tensor]:
        """Bucket i's tensors as views of the staging memory (their dtypes and shapes)."""
        if self._typed[i] is None:
            self._typed[i] = [t for _, t in unpack(self.buckets[i], self.views[i])]
        return self._typed[i]

    def fill(self, i: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy bucket i's tensors (in the plan's order, dtypes and shapes) into it; its view."""
        import torch

        dst = self.typed(i)
        if len(tensors) != len(dst):
            raise ValueError(f"bucket {i} holds {len(dst)} tensors, {len(tensors)} given")
        for meta, d, t in zip(self.buckets[i].tensors, dst, tensors, strict=True):
            if t.shape != d.shape or t.dtype != d.dtype:
                raise ValueError(
                    f"{meta.name}: tensor is {dtype_name(t.dtype)}{tuple(t.shape)}, plan says {meta.dtype}{meta.shape}"
                )
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, list(tensors))
        return self.views[i]
