"""GeneratorService messages <-> the engine's domain values, with the contract's defaults and
bounds; every error names the field. The servicer calls these and nothing else touches protos
(a weight push's bucket plan is read by ``relayrl.common.weightsync.plan.plan_from_proto``)."""

from __future__ import annotations

from relayrl.common.rpc import InvalidRequest, bounded
from relayrl.common.v1 import common_pb2
from relayrl.common.weightsync import shm
from relayrl.common.weightsync.cudaipc import shared_from_proto
from relayrl.generator.engine import (
    BucketSource,
    SampleOut,
    SamplingSpec,
    SyncSpec,
)
from relayrl.generator.v1 import generator_pb2

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


MAX_STOPS = 64
"""Most stop strings (and stop token ids) a request may give."""
MAX_STOP_CHARS = 256
"""Longest stop string (each is searched in the text after every token)."""
MAX_SYNC_TIMEOUT_S = 86400.0
"""Longest InitWeightSync timeout accepted (a day)."""
MAX_TEMPERATURE = 100.0
"""Highest sampling temperature accepted (engines may allow less: vLLM stops at 2)."""
MAX_VERSION = (1 << 53) - 1
"""Highest policy version accepted: a version near 2^64 would leave no newer one to send (and
2^53 is where a double, as JSON and many clients carry numbers, stops counting exactly)."""
MAX_WORLD_SIZE = 1 << 16
"""Most ranks a weight-sync group may have (the learner and every generator worker)."""


def check_version(version: int) -> int:
    """A request's policy version, within bounds (``MAX_VERSION``)."""
    if version > MAX_VERSION:
        raise InvalidRequest(f"version must be at most 2^53 - 1, got {version}")
    return version


def sampling_from_proto(p: generator_pb2.SamplingParams) -> SamplingSpec:
    """Apply the contract's defaults and bounds; errors name the field."""
    if p.n < 1:
        raise InvalidRequest("sampling.n must be at least 1")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not 0 <= temperature <= MAX_TEMPERATURE:  # also refuses NaN
        raise InvalidRequest(f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
    if p.top_k < -1:
        raise InvalidRequest(f"sampling.top_k must be -1, 0 (off) or positive, got {p.top_k}")
    if len(p.stop) > MAX_STOPS or len(p.stop_token_ids) > MAX_STOPS:
        raise InvalidRequest(
            f"sampling.stop and sampling.stop_token_ids take at most {MAX_STOPS} values each"
        )
    if any(not 0 < len(s) <= MAX_STOP_CHARS for s in p.stop):
        raise InvalidRequest(f"sampling.stop strings must have 1 to {MAX_STOP_CHARS} characters")
    return SamplingSpec(
        n=p.n,
        temperature=temperature,
        top_p=top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=p.max_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos,
    )


def sample_to_proto(s: SampleOut) -> common_pb2.Sample:
    return common_pb2.Sample(
        prompt_id=s.prompt_id,
        sample_index=s.sample_index,
        prompt_token_ids=s.prompt_token_ids,
        completion_token_ids=s.token_ids,
        logprobs=s.logprobs,
        finish_reason=_FINISH[s.finish_reason],
        policy_version=s.policy_version,
        # A single span is implied by policy_version; spans are only sent when a swap split it.
        version_spans=[common_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in s.version_spans]
        if len(s.version_spans) > 1
        else [],
        replica_id=s.replica_id,
        text=s.text,
    )


TRANSPORT_PROTO = {
    "gloo": generator_pb2.WEIGHT_TRANSPORT_GLOO,
    "nccl": generator_pb2.WEIGHT_TRANSPORT_NCCL,
    "shm": generator_pb2.WEIGHT_TRANSPORT_SHM,
    "ipc": generator_pb2.WEIGHT_TRANSPORT_IPC,
}
TRANSPORT_NAME = {v: k for k, v in TRANSPORT_PROTO.items()}


def sync_spec_from_proto(r: generator_pb2.InitWeightSyncRequest, device: str) -> SyncSpec:
    """Check an InitWeightSync request; errors name the field. ``device`` picks the backend of an
    unspecified transport (NCCL on GPUs), as before transports existed."""
    if not 0 <= r.timeout_seconds <= MAX_SYNC_TIMEOUT_S:  # also refuses NaN
        raise InvalidRequest(
            f"timeout_seconds must be in [0, {MAX_SYNC_TIMEOUT_S:g}], got {r.timeout_seconds}"
        )
    transport = TRANSPORT_NAME.get(r.transport)
    if transport is None:
        if r.transport != generator_pb2.WEIGHT_TRANSPORT_UNSPECIFIED:
            raise InvalidRequest(f"transport {r.transport} is not one this contract knows")
        if r.backend not in ("", "gloo", "nccl"):
            raise InvalidRequest(f"backend must be 'nccl', 'gloo' or empty, got {bounded(r.backend, 40)!r}")
        transport = r.backend or ("nccl" if device == "cuda" else "gloo")
    timeout = r.timeout_seconds or 300.0
    if transport in ("shm", "ipc"):
        if transport == "shm" and not shm.valid_name(r.shm_probe):
            raise InvalidRequest(f"shm_probe {bounded(r.shm_probe, 140)!r} is not a relayrl segment name")
        if transport == "ipc" and not r.HasField("ipc_probe"):
            raise InvalidRequest("ipc_probe is required for the ipc transport")
        probe = shared_from_proto(r.ipc_probe) if transport == "ipc" else None
        return SyncSpec(
            transport,
            shm_probe=r.shm_probe,
            ipc_probe=probe,
            probe_checksum=r.probe_checksum,
            timeout_s=timeout,
        )
    if not r.master_addr or not r.master_port:
        raise InvalidRequest("master_addr and master_port are required")
    if len(r.master_addr) > 255:
        raise InvalidRequest("master_addr takes at most 255 characters")
    if r.master_port > 65535:
        raise InvalidRequest(f"master_port must be 1-65535, got {r.master_port}")
    if len(r.group_name) > 128:
        raise InvalidRequest("group_name takes at most 128 characters")
    if not 2 <= r.world_size <= MAX_WORLD_SIZE:
        raise InvalidRequest(f"world_size must be 2-{MAX_WORLD_SIZE}, got {r.world_size}")
    return SyncSpec(
        transport,
        r.master_addr,
        r.master_port,
        r.world_size,
        r.rank,
        r.group_name or "relayrl-weights",
        timeout,
    )


def source_from_proto(r: generator_pb2.UpdateWeightsRequest, n_buckets: int) -> BucketSource | None:
    """Where the request's buckets are (None: the open group broadcasts them)."""
    kind = r.WhichOneof("source")
    if kind == "shm":
        if not shm.valid_name(r.shm.segment):
            raise InvalidRequest(f"shm.segment {bounded(r.shm.segment, 140)!r} is not a relayrl segment name")
        if len(r.shm.offsets) != n_buckets:
            raise InvalidRequest(f"shm.offsets has {len(r.shm.offsets)} entries for {n_buckets} buckets")
        if r.shm.push_id >= 1 << 63:
            raise InvalidRequest("shm.push_id must be below 2^63")
        return BucketSource(
            shm_segment=r.shm.segment,
            shm_offsets=tuple(r.shm.offsets),
            shm_push_id=r.shm.push_id,
            shm_ready_offset=r.shm.ready_offset,
        )
    if kind == "ipc":
        if len(r.ipc.buffers) != n_buckets:
            raise InvalidRequest(f"ipc.buffers has {len(r.ipc.buffers)} entries for {n_buckets} buckets")
        return BucketSource(ipc=tuple(shared_from_proto(b) for b in r.ipc.buffers))
    return None
