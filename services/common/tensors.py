"""Tensors on the wire: ``relayrl.common.v1.DType`` <-> weightsync's dtype names, and bucket
plans -> ``relayrl.common.v1.BucketPlan`` (the learner sends them; generators parse them in
their servicer, with validation)."""

from __future__ import annotations

from relayrl.common import weightsync as ws
from relayrl.common.cudaipc import FIELDS, Shared
from relayrl.common.v1 import common_pb2

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


def plan_to_proto(buckets: list[ws.Bucket]) -> common_pb2.BucketPlan:
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


def shared_to_proto(s: Shared) -> common_pb2.CudaIpcBuffer:
    return common_pb2.CudaIpcBuffer(**{f: getattr(s, f) for f in FIELDS})


def shared_from_proto(p: common_pb2.CudaIpcBuffer) -> Shared:
    return Shared(**{f: getattr(p, f) for f in FIELDS})
