"""CUDA buffers shared between processes on one GPU, as plain fields (never pickle).

``share(buf)`` gives the fields of torch's own CUDA storage sharing
(``torch.multiprocessing.reductions.reduce_tensor``: the cudaIpcMemHandle of the allocation, the
storage's offset and size in it, torch's reference counter and an event to wait on);
``open_shared(fields, device)`` rebuilds a tensor over the same memory in another process, on the
device index that process gives the same GPU (the learner and a generator may number it
differently; the caller checks the GPU's UUID). ``window(fields, offset, nbytes)`` names a part
of a shared buffer (a bucket of a staging buffer shared once): the receiver opens it as a buffer
of its own, over the same allocation. The sender keeps ``buf`` alive and unchanged until the
receiver says it is done with it. ``shared_to_proto`` / ``shared_from_proto``: the same fields as a
``relayrl.common.v1.CudaIpcBuffer``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relayrl.common.v1 import common_pb2

FIELDS = (
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "device",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
    "nbytes",
)


@dataclass(frozen=True)
class Shared:
    """What crosses the wire for one shared uint8 CUDA buffer (``CudaIpcBuffer`` in the contract)."""

    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    device: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int


def share(buf) -> Shared:
    """The sharing fields of a contiguous uint8 CUDA tensor that starts at its storage's start."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if buf.dtype != torch.uint8 or not buf.is_cuda or buf.storage_offset() or not buf.is_contiguous():
        raise ValueError("share() takes a contiguous uint8 CUDA tensor at the start of its storage")
    _rebuild, args = reduce_tensor(buf)
    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size_bytes,
    #  storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
    #  event_sync_required): torch's order since 2.0.
    (
        _cls,
        _size,
        _stride,
        _offset,
        _scls,
        _dtype,
        device,
        handle,
        size,
        offset,
        _rg,
        rc,
        rc_off,
        ev,
        ev_sync,
    ) = args
    return Shared(bytes(handle), int(size), int(offset), int(device), bytes(rc), int(rc_off), bytes(ev or b""),
                  bool(ev_sync), int(buf.numel()))  # fmt: skip


def window(s: Shared, offset: int, nbytes: int) -> Shared:
    """The fields of ``nbytes`` bytes at ``offset`` of the shared buffer ``s``: a storage of its
    own at that offset of the same allocation (the receiver opens the handle once; torch keeps one
    mapping per handle however many storages are rebuilt over it).

    >>> s = Shared(b"h", 4096, 512, 0, b"rc", 3, b"ev", True, 1000)
    >>> w = window(s, 128, 64)
    >>> (w.storage_offset_bytes, w.storage_size_bytes, w.nbytes, w.handle, w.ref_counter_offset)
    (640, 64, 64, b'h', 3)
    >>> window(s, 960, 64)
    Traceback (most recent call last):
    ...
    ValueError: a window of 64 bytes at 960 does not fit a shared buffer of 1000
    """
    if offset < 0 or nbytes < 0 or offset + nbytes > s.nbytes:
        raise ValueError(f"a window of {nbytes} bytes at {offset} does not fit a shared buffer of {s.nbytes}")
    return replace(
        s, storage_offset_bytes=s.storage_offset_bytes + offset, storage_size_bytes=nbytes, nbytes=nbytes
    )


def open_shared(s: Shared, device: int):
    """A uint8 tensor over the memory ``s`` names, on this process's CUDA device ``device``."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    t = rebuild_cuda_tensor(
        torch.Tensor, (s.nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, device, s.handle,
        s.storage_size_bytes, s.storage_offset_bytes, False, s.ref_counter_handle, s.ref_counter_offset,
        s.event_handle or None, s.event_sync_required,
    )  # fmt: skip
    return t


def shared_to_proto(s: Shared) -> common_pb2.CudaIpcBuffer:
    return common_pb2.CudaIpcBuffer(**{f: getattr(s, f) for f in FIELDS})


def shared_from_proto(p: common_pb2.CudaIpcBuffer) -> Shared:
    return Shared(**{f: getattr(p, f) for f in FIELDS})
