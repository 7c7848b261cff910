"""Server reflection, v1 and v1alpha, on a real server built by ``create_server`` on 127.0.0.1.

A client that knows only ``grpc.reflection.v1`` (grpcurl, Node's reflection clients) must find the
services, and describe them, without a token even when the service asks every other call for one.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from relayrl.common.grpc_server import create_server, start
from relayrl.common.reflection import V1_SERVICE, V1ALPHA_SERVICE, ensure_v1_descriptor
from relayrl.common.serving import ServeConfig
from relayrl.reward.v1 import reward_pb2, reward_pb2_grpc

SERVICE = "relayrl.reward.v1.RewardService"
# ServerReflectionRequest{list_services: ""}, encoded by hand (field 7, length-delimited, empty):
# what any v1 client sends, whatever library it uses.
LIST_SERVICES = b"\x3a\x00"


@pytest.fixture
async def server(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    handle = create_server(
        reward_pb2_grpc.RewardServiceServicer(),
        reward_pb2.DESCRIPTOR.services_by_name["RewardService"],
        ServeConfig(token_file=str(token)),
    )
    await start(handle, ready=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            yield channel
    finally:
        await handle.server.stop(None)


def _v1(name: str):
    ensure_v1_descriptor()
    return GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(f"grpc.reflection.v1.{name}"))


async def test_v1_client_lists_and_describes_the_services_without_a_token(server) -> None:
    response_cls = _v1("ServerReflectionResponse")
    call = server.stream_stream(
        f"/{V1_SERVICE}/ServerReflectionInfo",
        request_serializer=lambda b: b,
        response_deserializer=response_cls.FromString,
    )
    describe = _v1("ServerReflectionRequest")(file_containing_symbol=SERVICE).SerializeToString()
    listed, described = [r async for r in call(iter([LIST_SERVICES, describe]), timeout=10)]
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", V1_SERVICE, V1ALPHA_SERVICE} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    assert "relayrl/reward/v1/reward.proto" in {f.name for f in files}  # enough to build a client


async def test_v1_describes_itself(server) -> None:
    call = server.stream_stream(
        f"/{V1_SERVICE}/ServerReflectionInfo",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=_v1("ServerReflectionResponse").FromString,
    )
    request = _v1("ServerReflectionRequest")(file_containing_symbol=V1_SERVICE)
    (found,) = [r async for r in call(iter([request]), timeout=10)]
    (raw,) = found.file_descriptor_response.file_descriptor_proto
    file = descriptor_pb2.FileDescriptorProto.FromString(raw)
    assert (file.name, file.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert file.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


async def test_v1alpha_still_served(server) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(server)
    (listed,) = [
        r
        async for r in stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
    ]
    assert SERVICE in {s.name for s in listed.list_services_response.service}


async def test_the_service_itself_still_needs_the_token(server) -> None:
    stub = reward_pb2_grpc.RewardServiceStub(server)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListScorers(reward_pb2.ListScorersRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
