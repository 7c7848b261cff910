"""RewardService RPCs: proto -> ScoreItem, the scoring pool, results -> proto. Nothing else.

A replica that cannot score (no scoring worker can be started) fails a call UNAVAILABLE with the
reason, never with per-sample errors. A bad request (no items, an item without data_source, extra_info_json that is not a JSON object,
a timeout out of range, fields from a newer contract) is INVALID_ARGUMENT for the whole call. What
goes wrong with one sample (unknown data source, a scorer that raises, hangs or returns garbage)
is that sample's status, and the rest of the batch is scored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from relayrl.common.rpc import InvalidRequest, ResourceExhausted, ServiceError, bounded, map_errors
from relayrl.reward import metrics
from relayrl.reward.config import RewardConfig
from relayrl.reward.pool import ERROR, OK, TIMEOUT, SampleResult, ScoreItem, ScoringPool
from relayrl.reward.v1 import reward_pb2, reward_pb2_grpc

logger = logging.getLogger(__name__)

MAX_TIMEOUT_SECONDS = 600.0
MAX_EXTRA_INFO_CHARS = 65536
_STATUS = {
    OK: reward_pb2.SCORE_STATUS_OK,
    ERROR: reward_pb2.SCORE_STATUS_ERROR,
    TIMEOUT: reward_pb2.SCORE_STATUS_TIMEOUT,
}


def item_from_proto(index: int, x: reward_pb2.RewardInput, max_chars: int) -> ScoreItem:
    where = f"items[{index}] ({bounded(repr(x.sample_id), 80)})" if x.sample_id else f"items[{index}]"
    if not x.data_source:
        raise InvalidRequest(f"{where}: data_source is empty")
    for name in ("completion", "ground_truth", "prompt", "data_source"):
        if len(getattr(x, name)) > max_chars:
            raise InvalidRequest(f"{where}: {name} is longer than {max_chars} characters (max_text_chars)")
    if len(x.extra_info_json) > MAX_EXTRA_INFO_CHARS:
        raise InvalidRequest(f"{where}: extra_info_json is longer than {MAX_EXTRA_INFO_CHARS} characters")
    extra: object = {}
    if x.extra_info_json:
        try:
            extra = json.loads(x.extra_info_json)
        except (ValueError, RecursionError) as e:
            raise InvalidRequest(f"{where}: extra_info_json is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise InvalidRequest(
                f"{where}: extra_info_json must be a JSON object, got {type(extra).__name__}"
            )
    return ScoreItem(x.data_source, x.completion, x.ground_truth, extra, x.prompt)


def result_to_proto(sample_id: str, r: SampleResult) -> reward_pb2.RewardResult:
    """Only an OK result carries a reward and components: an ERROR or TIMEOUT is never a score."""
    if r.status != OK:
        return reward_pb2.RewardResult(sample_id=sample_id, status=_STATUS[r.status], error=r.error)
    return reward_pb2.RewardResult(
        sample_id=sample_id, reward=r.reward, components=r.components, status=_STATUS[OK]
    )


def _code(e: BaseException) -> str:
    """The status code name a failed call ends with (the metric's label)."""
    if isinstance(e, ServiceError):
        return e.code.name
    return "INTERNAL" if isinstance(e, Exception) else "CANCELLED"


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, pool: ScoringPool, config: RewardConfig):
        self.pool = pool
        self.config = config
        self.default_timeout = config.timeout_seconds
        self.pending_items = 0

    @map_errors
    async def Score(self, request, context):
        t0, code = time.monotonic(), "OK"
        request_id = request.request_id or uuid.uuid4().hex
        cfg, taken = self.config, 0
        try:
            if not request.items:
                raise InvalidRequest("items is empty")
            if len(request.items) > cfg.max_items_per_request:
                raise InvalidRequest(
                    f"{len(request.items)} items; at most {cfg.max_items_per_request} (max_items_per_request)"
                )
            timeout = request.timeout_seconds
            if not 0 <= timeout <= MAX_TIMEOUT_SECONDS:
                raise InvalidRequest(
                    f"timeout_seconds must be in [0, {MAX_TIMEOUT_SECONDS:g}] (0: default), got {timeout}"
                )
            items = [item_from_proto(i, x, cfg.max_text_chars) for i, x in enumerate(request.items)]
            if self.pending_items + len(items) > cfg.max_pending_items:
                raise ResourceExhausted(
                    f"{self.pending_items} samples already queued; this call's {len(items)} would pass "
                    f"max_pending_items {cfg.max_pending_items}"
                )
            self.pending_items += (taken := len(items))
            metrics.PENDING.set(self.pending_items)
            results = await self.pool.score(items, timeout or self.default_timeout)
        except BaseException as e:
            code = _code(e)
            raise
        finally:
            self.pending_items -= taken
            metrics.PENDING.set(self.pending_items)
            metrics.REQUESTS.labels(code).inc()
            metrics.REQUEST_SECONDS.observe(time.monotonic() - t0)
        known = self.pool.data_sources
        for item, r in zip(items, results, strict=True):
            source = item.data_source if item.data_source in known else "unknown"
            metrics.SAMPLES.labels(source, r.status).inc()
            if r.seconds:
                metrics.SAMPLE_SECONDS.labels(source).observe(r.seconds)
        if timeouts := sum(r.status == TIMEOUT for r in results):
            logger.warning("request %s: %d of %d samples timed out", request_id, timeouts, len(results))
        logger.debug("request %s: scored %d samples", request_id, len(results))
        return reward_pb2.ScoreResponse(
            results=[result_to_proto(x.sample_id, r) for x, r in zip(request.items, results, strict=True)]
        )

    @map_errors
    async def ListScorers(self, request, context):
        return reward_pb2.ListScorersResponse(
            scorers=[
                reward_pb2.ScorerInfo(data_source=s.data_source, from_plugin=s.from_plugin, origin=s.origin)
                for s in self.pool.scorers
            ]
        )
