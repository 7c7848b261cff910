"""Tensor dtypes on the wire: ``relayrl.common.v1.DType`` <-> the dtype names of weightsync."""

from __future__ import annotations

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
