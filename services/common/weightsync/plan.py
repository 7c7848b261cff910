"""The bucket plan of a push: which tensors travel in which flat uint8 bucket, at which offset.

The learner computes it once per push (``plan_buckets``, pure) from its parameters' names,
dtypes and shapes, and hands the same plan to everything that needs it: its own gather and send,
its other ranks (``plan_to_plain`` over the control channel), every generator (``plan_to_proto`` in
``UpdateWeights``). It changes form only where a wire forces it:

=============================  ==============================  ===============================
hop                            form                            functions
=============================  ==============================  ===============================
learner -> generator (gRPC)    ``relayrl.common.v1.BucketPlan``  ``plan_to_proto`` / ``plan_from_proto``
engine -> vLLM worker          plain lists and dicts           ``plan_to_plain`` / ``plan_from_plain``
(``collective_rpc``), rank 0
-> other learner ranks
=============================  ==============================  ===============================

``plan_from_proto`` is where a plan from the network is checked (tensors in order, aligned, without
overlap, filling each bucket exactly); ``check_plan`` checks it against a model's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relayrl.common.rpc import InvalidRequest
from relayrl.common.v1 import common_pb2

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


SOLO_BYTES = 32 << 20
"""Tensors this large travel alone: a group broadcasts them in place, with no packing copy. Below
it, tensors are packed: every bucket costs a ready mark, a checksum kernel and, over a group, a
broadcast, and at 4 MiB the 0.5B model's MLP weights (8.7 MB each) made 98 buckets of a push."""


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


def layout(buckets: Sequence[Bucket], start: int = 0) -> tuple[tuple[int, ...], int]:
    """Where each bucket lies in one flat buffer holding them all (staging memory: one allocation,
    a view per bucket), from ``start``, each at an aligned offset; and the buffer's size.

    >>> layout([Bucket((), (), 10), Bucket((), (), 64), Bucket((), (), 1)], start=32)
    ((64, 128, 192), 256)
    """
    offsets, end = [], aligned(start)
    for b in buckets:
        offsets.append(end)
        end = aligned(end + b.nbytes)
    return tuple(offsets), end


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


# -- the plan's forms on its wires ------------------------------------------------------------
DTYPE_TO_PROTO = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "int64": common_pb2.DTYPE_INT64,
    "int32": common_pb2.DTYPE_INT32,
    "uint8": common_pb2.DTYPE_UINT8,
    "bool": common_pb2.DTYPE_BOOL,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_TO_PROTO.items()}


def plan_to_proto(buckets: Sequence[Bucket]) -> common_pb2.BucketPlan:
    """The plan as the learner sends it in ``UpdateWeights``."""
    return common_pb2.BucketPlan(
        buckets=[
            common_pb2.Bucket(
                tensors=[
                    common_pb2.TensorSpec(name=m.name, dtype=DTYPE_TO_PROTO[m.dtype], shape=m.shape)
                    for m in b.tensors
                ],
                nbytes=b.nbytes,
                offsets=b.offsets,
            )
            for b in buckets
        ]
    )


def tensor_meta(name: str, dtype_enum: int, shape) -> TensorMeta:
    """A tensor's description from its proto fields (InvalidRequest naming it when it is bad)."""
    dtype = DTYPE_NAMES.get(dtype_enum)
    if dtype is None:
        raise InvalidRequest(f"{name}: dtype missing or unsupported")
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"{name}: negative dimension in shape {tuple(shape)}")
    return TensorMeta(name, dtype, tuple(shape))


def bucket_from_proto(b: common_pb2.Bucket) -> Bucket:
    """A bucket whose tensors lie in order, aligned, without overlap, and fill it exactly."""
    if len(b.offsets) != len(b.tensors):
        raise InvalidRequest(f"bucket has {len(b.tensors)} tensors but {len(b.offsets)} offsets")
    metas = tuple(tensor_meta(t.name, t.dtype, t.shape) for t in b.tensors)
    end = 0
    for m, off in zip(metas, b.offsets, strict=True):
        if off % ALIGN or off < end:
            raise InvalidRequest(f"{m.name}: offset {off} is unaligned or overlaps the previous tensor")
        end = off + m.nbytes
    if end != b.nbytes:
        raise InvalidRequest(f"bucket nbytes {b.nbytes} does not match its tensors (they end at {end})")
    return Bucket(metas, tuple(b.offsets), b.nbytes)


def plan_from_proto(p: common_pb2.BucketPlan) -> list[Bucket]:
    """The plan a generator received, checked bucket by bucket (``bucket_from_proto``)."""
    return [bucket_from_proto(b) for b in p.buckets]


def plan_to_plain(buckets: Sequence[Bucket]) -> list[dict]:
    """The plan as plain lists and dicts: what survives ``collective_rpc`` (into vLLM's workers)
    and the learner's JSON control channel (to its other ranks).

    >>> p = plan_buckets([TensorMeta("a", "float32", (2, 3))], 1 << 10)
    >>> plan_to_plain(p)
    [{'tensors': [{'name': 'a', 'dtype': 'float32', 'shape': [2, 3]}], 'offsets': [0], 'nbytes': 24}]
    >>> plan_from_plain(plan_to_plain(p)) == p
    True
    """
    return [
        {
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in b.tensors],
            "offsets": list(b.offsets),
            "nbytes": b.nbytes,
        }
        for b in buckets
    ]


def plan_from_plain(plan: list[dict]) -> list[Bucket]:
    """Buckets back from ``plan_to_plain``'s form (it comes from this process's own peers)."""
    return [
        Bucket(
            tensors=tuple(TensorMeta(t["name"], t["dtype"], tuple(t["shape"])) for t in b["tensors"]),
            offsets=tuple(b["offsets"]),
            nbytes=b["nbytes"],
        )
        for b in plan
    ]
