"""The coordinator's LearnerClient against a recording LearnerService: the order in which the
learner sees a failed generator's unregistration and the calls that follow it."""

from __future__ import annotations

import asyncio
import contextlib

from relayrl.common.grpc_server import create_server, start
from relayrl.common.rpc import Unavailable, map_errors
from relayrl.coordinator.clients.learner import LearnerClient
from relayrl.learner.v1 import learner_pb2, learner_pb2_grpc


@contextlib.asynccontextmanager
async def recording_learner(unregister_s: float, fail_unregister: bool = False):
    seen: list[str] = []

    class Recording(learner_pb2_grpc.LearnerServiceServicer):
        @map_errors
        async def UnregisterGenerator(self, request, context):
            await asyncio.sleep(unregister_s)  # slower than what follows it, as under load
            if fail_unregister:
                raise Unavailable("learner busy")
            seen.append(f"unregister {request.replica_id}")
            return learner_pb2.UnregisterGeneratorResponse()

        @map_errors
        async def RegisterGenerator(self, request, context):
            seen.append(f"register {request.replica_id}")
            return learner_pb2.RegisterGeneratorResponse(policy_version=3)

        @map_errors
        async def PushWeights(self, request, context):
            seen.append(f"push {request.version}")
            return learner_pb2.PushWeightsResponse(version=request.version)

    handle = create_server(Recording(), learner_pb2.DESCRIPTOR.services_by_name["LearnerService"])
    await start(handle, ready=True)
    client = LearnerClient(f"127.0.0.1:{handle.port}", deadline=30)
    try:
        yield client, seen
    finally:
        await client.close()
        await handle.stop(0)


async def test_a_push_after_a_replica_failed_reaches_the_learner_after_its_unregistration():
    """Otherwise the learner pushes to a group that still holds the dead replica (the broadcast
    fails for every replica), or undoes the registration of the replica that came back."""
    async with recording_learner(unregister_s=0.3) as (client, seen):
        client.forget_soon("gen-1")
        await client.push_weights(3)
        client.forget_soon("gen-1")
        await client.register_generator("gen-1", "127.0.0.1:1")
    assert seen == ["unregister gen-1", "push 3", "unregister gen-1", "register gen-1"]


async def test_a_failed_unregistration_does_not_hold_up_the_push(caplog):
    async with recording_learner(unregister_s=0.05, fail_unregister=True) as (client, seen):
        client.forget_soon("gen-1")
        await client.push_weights(3)
    assert seen == ["push 3"]
    assert any("unregistering a failed generator" in r.getMessage() for r in caplog.records)
