"""Run id, step and policy version travel as metadata and land in every log line of the service
that handles the call (``relayrl.common.logcontext``), unary and streaming alike."""

from __future__ import annotations

import asyncio
import logging

import grpc
from relayrl.common import logcontext
from relayrl.common.grpc_server import create_server, start
from relayrl.common.rpc import map_errors
from relayrl.reward.v1 import reward_pb2 as r
from relayrl.reward.v1 import reward_pb2_grpc as rg

log = logging.getLogger("relayrl.test.logcontext")


class Logging(rg.RewardServiceServicer):
    @map_errors
    async def Score(self, request, context):
        log.warning("scoring %d", len(request.items))
        await asyncio.sleep(0)  # the context survives a switch to other tasks
        log.warning("scored")
        return r.ScoreResponse()

    @map_errors
    async def ListScorers(self, request, context):
        log.warning("listing")
        return r.ListScorersResponse()


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.addFilter(logcontext.ContextFilter())
        self.setFormatter(logging.Formatter(logcontext.FORMAT))

    def emit(self, record):
        self.lines.append(self.format(record))


async def test_the_callers_run_step_and_version_are_in_the_services_log_lines():
    records = Records()
    log.addHandler(records)
    handle = create_server(Logging(), r.DESCRIPTOR.services_by_name["RewardService"])
    await start(handle, ready=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = rg.RewardServiceStub(ch)
            with logcontext.bound(run_id="exp-7", step=12, version=11):
                meta = logcontext.current()
            both = [stub.Score(r.ScoreRequest(), metadata=meta), stub.ListScorers(r.ListScorersRequest())]
            await asyncio.gather(*both)
    finally:
        await handle.stop(0)
        log.removeHandler(records)
    tagged = [line for line in records.lines if "[run exp-7 step 12 v11]" in line]
    assert [line.rsplit(": ", 1)[1] for line in tagged] == ["scoring 0", "scored"]
    untagged = [line for line in records.lines if "listing" in line]
    assert untagged and "[run - step - v-]" in untagged[0]  # a call without metadata binds nothing


def test_metadata_leaves_out_what_is_unknown():
    assert logcontext.metadata("r1", None, 3) == (
        ("x-relayrl-run-id", "r1"),
        ("x-relayrl-policy-version", "3"),
    )
    assert logcontext.current() == ()
