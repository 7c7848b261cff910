"""gRPC server reflection in both versions: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

Clients that discover a service from the server (grpcurl, Postman, grpcui, Node's
``grpc-reflection-js``) ask ``grpc.reflection.v1.ServerReflection`` first, and recent ones no
longer fall back to v1alpha. grpcio-reflection (1.85) ships v1alpha only. The v1 contract is
v1alpha's under another package name: the same messages, field numbers and method, hence the same
bytes on the wire. So one servicer serves both, registered under each service name, and the v1
file (``grpc/reflection/v1/reflection.proto``) is built from v1alpha's descriptor with the package
renamed and added to the default descriptor pool, so a client that asks v1 to describe v1 itself
gets an answer too.

Both stay callable without a token (``security.OPEN_METHOD_PREFIXES``): discovery needs no secret.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as _v1alpha
from grpc_reflection.v1alpha import reflection_pb2

V1ALPHA_SERVICE = _v1alpha.SERVICE_NAME
"""``grpc.reflection.v1alpha.ServerReflection``."""
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
"""The stable name of the same service."""
V1_FILE = "grpc/reflection/v1/reflection.proto"
"""Name of the v1 file in the descriptor pool, as upstream names it."""
_OLD, _NEW = "grpc.reflection.v1alpha", "grpc.reflection.v1"


def _rename(type_name: str) -> str:
    """``.grpc.reflection.v1alpha.X`` -> ``.grpc.reflection.v1.X``; other names unchanged."""
    old = f".{_OLD}."
    return f".{_NEW}.{type_name[len(old) :]}" if type_name.startswith(old) else type_name


def _rename_message(msg: descriptor_pb2.DescriptorProto) -> None:
    for f in msg.field:
        if f.HasField("type_name"):  # assigning even "" would mark a scalar field as typed
            f.type_name = _rename(f.type_name)
    for nested in msg.nested_type:
        _rename_message(nested)


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The v1 reflection file: v1alpha's with the package (and every type reference) renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, _NEW
    proto.ClearField("options")  # v1alpha's java/objc names; v1 has its own, none needed here
    for msg in proto.message_type:
        _rename_message(msg)
    for service in proto.service:
        for method in service.method:
            method.input_type = _rename(method.input_type)
            method.output_type = _rename(method.output_type)
    return proto


def ensure_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add the v1 reflection file to ``pool`` (default: protobuf's default pool) unless there."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(v1_file_descriptor().SerializeToString())


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services."""
    ensure_v1_descriptor()
    servicer = _v1alpha.aio.ReflectionServicer((*service_names, V1_SERVICE, V1ALPHA_SERVICE))
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for name in (V1_SERVICE, V1ALPHA_SERVICE):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
