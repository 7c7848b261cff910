"""The generators behind the gateway: one Generate call per chat request, on the session's
replica while it serves (rendezvous on the episode id, where the earlier turns' tokens sit in the
prefix cache) and on the next one otherwise. Generator status codes become the gateway's errors:
a bad request stays one, a full replica is a 429 for the agent, a context with no room left is
``context_length_exceeded``; a replica that is down, or that answers with weights older than the
session's ``min_version`` (it restarted and waits for the current weights), is skipped. When no
replica answers and one of them was only stale, the agent gets 429 with Retry-After (the
staleness bound holds admission: the weights are on their way), else 503."""

from __future__ import annotations

import logging

import grpc
from relayrl.common import logcontext
from relayrl.common.affinity import ranked
from relayrl.common.security import client_channel
from relayrl.common.serving import ClientSecurity
from relayrl.common.v1 import common_pb2
from relayrl.gateway.api import BadRequest, Busy, ContextFull, Unavailable
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg

logger = logging.getLogger(__name__)
SKIP_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
"""Codes after which the call goes to the next replica (this one is gone or not serving)."""
OPTIONS = (("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20))


def version_of(s: common_pb2.Sample) -> int:
    return min([s.policy_version, *(sp.version for sp in s.version_spans)])


class Generators:
    """Generate calls on the configured replicas."""

    def __init__(
        self, addresses: list[str], security: ClientSecurity, deadline_s: float, retry_after_s: float
    ):
        self.addresses = list(addresses)
        self.channels = {a: client_channel(a, security, OPTIONS) for a in self.addresses}
        self.deadline_s = deadline_s
        self.retry_after_s = retry_after_s

    async def generate(
        self, prompt: common_pb2.Prompt, sampling: g.SamplingParams, affinity: str, min_version: int, rid: str
    ) -> common_pb2.Sample:
        """The one sample of ``prompt``. Raises BadRequest, ContextFull, Busy or Unavailable."""
        if not self.addresses:
            raise Unavailable("the gateway has no generators configured (gateway.generators)")
        why, stale = [], False
        for address in ranked(affinity, self.addresses):
            try:
                s = await self._call(address, prompt, sampling, rid)
            except grpc.aio.AioRpcError as e:
                code, detail = e.code(), (e.details() or "")[:300]
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Busy(f"the generators are full: {detail}", self.retry_after_s) from None
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    raise ContextFull(f"the model's context has no room left: {detail}") from None
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    raise BadRequest(f"the generator refused the request: {detail}") from None
                if code not in SKIP_CODES:
                    raise Unavailable(f"generator {address}: {code.name}: {detail}") from None
                why.append(f"{address}: {code.name}: {detail}")
                continue
            if version_of(s) < min_version:  # restarted with older weights: not this session's policy
                why.append(f"{address}: sampled with policy version {version_of(s)}, not {min_version}")
                stale = True
                continue
            if s.finish_reason == common_pb2.FINISH_REASON_ABORT:
                why.append(f"{address}: the generator aborted the request")
                continue
            return s
        if stale:  # the staleness bound: a replica is up but waits for its weights; try again soon
            raise Busy(
                "no generator holds this session's policy yet: " + "; ".join(why)[:800], self.retry_after_s
            )
        raise Unavailable("no generator answered: " + "; ".join(why)[:800])

    async def _call(
        self, address: str, prompt: common_pb2.Prompt, sampling: g.SamplingParams, rid: str
    ) -> common_pb2.Sample:
        call = gg.GeneratorServiceStub(self.channels[address]).Generate(
            g.GenerateRequest(request_id=rid, prompts=[prompt], sampling=sampling),
            timeout=self.deadline_s,
            metadata=logcontext.current(),
        )
        got = [s async for resp in call for s in resp.samples]
        if len(got) != 1:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"answered {len(got)} samples for one prompt with n=1 (a generator bug)",
            )
        return got[0]

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
