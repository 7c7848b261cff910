"""The bytes of a bucket: packing tensors into one flat uint8 buffer, viewing them out of it,
its checksum, and the check that no weight is NaN or infinite. Both ends use these, so what the
learner packs is what a generator unpacks, and both compute the same checksum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from relayrl.common.weightsync.plan import Bucket, TensorMeta

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
