"""GatewayService RPCs: bounds checked, the core's sessions, errors mapped to status codes
(INVALID_ARGUMENT naming the field, NOT_FOUND for an unknown key, RESOURCE_EXHAUSTED when
``max_sessions`` are open)."""

from __future__ import annotations

import math

from relayrl.common.rpc import InvalidRequest, NotFound, ResourceExhausted, map_errors
from relayrl.gateway.api import BadRequest, RewardSet, Unauthorized
from relayrl.gateway.core import GatewayCore, SessionLimit, UnknownSession
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.gateway.v1 import gateway_pb2_grpc as gwg

MAX_ID_CHARS = 256
MAX_KEY_CHARS = 256
MAX_STOP_TOKENS = 64


class GatewayServicer(gwg.GatewayServiceServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    @map_errors
    async def OpenSession(self, request: gw.OpenSessionRequest, context) -> gw.OpenSessionResponse:
        if not request.episode_id:
            raise InvalidRequest("episode_id is required")
        for name in ("episode_id", "request_id"):
            if len(getattr(request, name)) > MAX_ID_CHARS:
                raise InvalidRequest(f"{name} is longer than {MAX_ID_CHARS} characters")
        s = request.sampling
        if not s.max_tokens:
            raise InvalidRequest("sampling.max_tokens is required: the most one call may generate")
        if len(s.stop_token_ids) > MAX_STOP_TOKENS:
            raise InvalidRequest(f"sampling.stop_token_ids: at most {MAX_STOP_TOKENS}")
        # NaN passes every comparison: a NaN TTL would never expire.
        if not math.isfinite(request.ttl_seconds) or not 0 <= request.ttl_seconds <= 86400:
            raise InvalidRequest(
                f"ttl_seconds must be a finite number from 0 to 86400 (0: the gateway's "
                f"session_ttl_seconds), not {request.ttl_seconds!r}"
            )
        try:
            return self.core.open(request)
        except SessionLimit as e:
            raise ResourceExhausted(str(e)) from None

    @map_errors
    async def CloseSession(self, request: gw.CloseSessionRequest, context) -> gw.CloseSessionResponse:
        _check_key(request.session_key)
        try:
            return self.core.close(request.session_key)
        except UnknownSession as e:
            raise NotFound(str(e.args[0])) from None

    @map_errors
    async def SetReward(self, request: gw.SetRewardRequest, context) -> gw.SetRewardResponse:
        _check_key(request.session_key)
        try:
            self.core.set_reward(request.session_key, RewardSet(request.reward, dict(request.components)))
        except Unauthorized as e:
            raise NotFound(str(e)) from None
        except BadRequest as e:
            raise InvalidRequest(str(e)) from None
        return gw.SetRewardResponse()


def _check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(f"session_key must be 1 to {MAX_KEY_CHARS} characters")
