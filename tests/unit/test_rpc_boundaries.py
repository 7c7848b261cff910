"""What every service answers to requests that are not what the contract says, checked once for
the machinery they all share (``common.grpc_server.add_service`` + ``common.rpc.map_errors``) and
then that every RPC of every real servicer goes through it.

Classes of bad input: bytes that do not decode (garbage, a truncated varint, invalid UTF-8 in a
string field), fields the contract does not know (also on requests that have no fields), and
errors whose message would quote a huge input.
"""

from __future__ import annotations

import contextlib
import importlib

import grpc
import pytest
from relayrl.common.grpc_server import create_server, start
from relayrl.common.rpc import InvalidRequest, map_errors

SERVICES = {
    "generator": ("relayrl.generator.v1.generator_pb2", "GeneratorService", "relayrl.generator.servicer", "GeneratorServicer"),
    "learner": ("relayrl.learner.v1.learner_pb2", "LearnerService", "relayrl.learner.servicer", "LearnerServicer"),
    "reward": ("relayrl.reward.v1.reward_pb2", "RewardService", "relayrl.reward.servicer", "RewardServicer"),
    "coordinator": ("relayrl.coordinator.v1.coordinator_pb2", "CoordinatorService", "relayrl.coordinator.service.servicer", "CoordinatorServicer"),
    "env": ("relayrl.env.v1.env_pb2", "EnvService", "relayrl.env.servicer", "EnvServicer"),
}  # fmt: skip


def descriptor(name: str):
    module, service, *_ = SERVICES[name]
    return importlib.import_module(module).DESCRIPTOR.services_by_name[service]


def echo_servicer(desc, detail: str = "refused"):
    """A servicer whose every RPC refuses with ``detail`` (after map_errors checked the request)."""

    async def unary(self, request, context):
        if hasattr(request, "__aiter__"):  # a client stream: read it (map_errors checks each message)
            async for _ in request:
                pass
        raise InvalidRequest(detail)

    async def streaming(self, request, context):
        raise InvalidRequest(detail)
        yield

    body = {m.name: map_errors(streaming if m.server_streaming else unary) for m in desc.methods}
    return type("Echo", (), body)()


@contextlib.asynccontextmanager
async def channel_to(servicer, desc):
    handle = create_server(servicer, desc)
    await start(handle, ready=True)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield ch
    finally:
        await ch.close()
        await handle.stop(0)


async def call_raw(ch, desc, method, payload: bytes):
    """Send ``payload`` as the request bytes of ``method``; return the error it ends with."""
    path = f"/{desc.full_name}/{method.name}"
    kind = {
        (False, False): ch.unary_unary,
        (False, True): ch.unary_stream,
        (True, False): ch.stream_unary,
        (True, True): ch.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    call = kind(path, request_serializer=None, response_deserializer=None)
    arg = iter([payload]) if method.client_streaming else payload
    with pytest.raises(grpc.aio.AioRpcError) as e:
        result = call(arg, timeout=10)
        if method.server_streaming:
            async for _ in result:
                pass
        else:
            await result
    return e.value


BAD_BYTES = {
    "garbage": b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
    "truncated varint": b"\x08\x80",
    "field past the end": b"\x0a\x10abc",
    "unknown field": b"\xf8\x06\x01",  # field 111, varint 1: decodes, but no contract has it
}


@pytest.mark.parametrize("service", sorted(SERVICES))
@pytest.mark.parametrize("bad", sorted(BAD_BYTES))
async def test_bad_request_bytes_are_invalid_argument_on_every_rpc(service, bad):
    desc = descriptor(service)
    async with channel_to(echo_servicer(desc), desc) as ch:
        for method in desc.methods:
            err = await call_raw(ch, desc, method, BAD_BYTES[bad])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.name, err)
            assert err.details() != "refused", f"{method.name}: the servicer saw {bad!r}"


async def test_invalid_utf8_in_a_string_field_is_invalid_argument():
    desc = descriptor("coordinator")
    method = desc.methods_by_name["GetExperimentStatus"]
    async with channel_to(echo_servicer(desc), desc) as ch:
        err = await call_raw(ch, desc, method, b"\x0a\x02\xc3\x28")  # run_id = invalid UTF-8
        assert (
            err.code() == grpc.StatusCode.INVALID_ARGUMENT and "GetExperimentStatusRequest" in err.details()
        )


async def test_error_details_are_bounded_whatever_the_input():
    desc = descriptor("reward")
    huge = "x" * (1 << 20)
    async with channel_to(echo_servicer(desc, huge), desc) as ch:
        err = await call_raw(ch, desc, desc.methods_by_name["Score"], b"")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED (metadata size)
        assert len(err.details()) < 1100 and err.details().endswith("more characters)")


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_rpc_of_every_servicer_maps_errors(service):
    """The checks above apply to a real servicer only if each RPC is wrapped by map_errors."""
    *_, module, cls = SERVICES[service]
    servicer = getattr(importlib.import_module(module), cls)
    for method in descriptor(service).methods:
        assert getattr(getattr(servicer, method.name), "maps_errors", False), f"{cls}.{method.name}"
