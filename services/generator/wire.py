"""GeneratorService messages <-> the engine's domain values, with the contract's defaults and
bounds; every error names the field. The servicer calls these and nothing else touches protos
(a weight push's bucket plan is read by ``relayrl.common.weightsync.plan.plan_from_proto``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from relayrl.common.rpc import InvalidRequest, bounded
from relayrl.common.v1 import common_pb2
from relayrl.common.weightsync import shm
from relayrl.common.weightsync.adapters import MAX_TARGETS, AdapterSpec
from relayrl.common.weightsync.cudaipc import shared_from_proto
from relayrl.generator.bridge import MAX_APPEND, ChatCheck, check_append
from relayrl.generator.constraints import FUNCTION, REQUIRED
from relayrl.generator.engine import (
    BucketSource,
    SampleOut,
    SamplingSpec,
    SyncSpec,
)
from relayrl.generator.toolcalls import FORMATS, MAX_CALLS, MAX_NAME_CHARS, ParsedCall, openai_tool_call
from relayrl.generator.v1 import generator_pb2

_TOOL_CHOICES = {
    generator_pb2.TOOL_CHOICE_UNSPECIFIED: "",
    generator_pb2.TOOL_CHOICE_REQUIRED: REQUIRED,
    generator_pb2.TOOL_CHOICE_FUNCTION: FUNCTION,
}
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
MAX_TOOLS_JSON_CHARS = 64 * 1024
"""Longest tools_json (the tools offered to the model)."""
MAX_TOOL_CALL_ID_CHARS = 64
"""Longest ToolCall.id."""


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
    tool_format = check_tool_format(p.tool_format, "sampling.tool_format")
    choice = _TOOL_CHOICES.get(p.tool_choice)
    if choice is None:
        raise InvalidRequest(f"sampling.tool_choice {p.tool_choice} is not one this contract knows")
    if choice and not tool_format:
        raise InvalidRequest("sampling.tool_choice needs sampling.tool_format (how the model writes calls)")
    if bool(p.tool_choice_function) != (choice == FUNCTION):
        raise InvalidRequest(
            "sampling.tool_choice_function is given with tool_choice TOOL_CHOICE_FUNCTION, and only then"
        )
    if len(p.tool_choice_function) > MAX_NAME_CHARS:
        raise InvalidRequest(f"sampling.tool_choice_function takes at most {MAX_NAME_CHARS} characters")
    if p.json_schema:
        check_json_schema(p.json_schema, "sampling.json_schema")
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
        tool_format=tool_format,
        fit_to_context=p.fit_to_context,
        tool_choice=choice,
        tool_choice_function=p.tool_choice_function,
        single_tool_call=p.single_tool_call,
        json_schema=p.json_schema,
    )


def check_json_schema(text: str, name: str) -> None:
    """A JSON schema given as text: a JSON object of at most ``MAX_TOOLS_JSON_CHARS``."""
    if len(text) > MAX_TOOLS_JSON_CHARS:
        raise InvalidRequest(f"{name}: {len(text)} characters; at most {MAX_TOOLS_JSON_CHARS}")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        schema = None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{name} must be a JSON schema object")


def check_tool_format(fmt: str, name: str) -> str:
    if fmt and fmt not in FORMATS:
        raise InvalidRequest(
            f"{name} must be empty, {' or '.join(map(repr, FORMATS))}; got {bounded(fmt, 40)!r}"
        )
    return fmt


def tools_from_json(tools_json: str, name: str) -> list[dict[str, Any]] | None:
    """The tools of a dialogue: a JSON array of OpenAI-style function schemas, or None when
    empty. Errors name the field."""
    if not tools_json:
        return None
    if len(tools_json) > MAX_TOOLS_JSON_CHARS:
        raise InvalidRequest(f"{name}: {len(tools_json)} characters; at most {MAX_TOOLS_JSON_CHARS}")
    try:
        tools = json.loads(tools_json)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"{name} is not JSON: {bounded(str(e), 200)}") from None
    if not isinstance(tools, list):
        raise InvalidRequest(f"{name} must be a JSON array of function schemas")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        tool_name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(tool_name, str) or not 0 < len(tool_name) <= MAX_NAME_CHARS:
            raise InvalidRequest(
                f'{name}[{i}] must be {{"type": "function", "function": {{"name": <1 to {MAX_NAME_CHARS} '
                "characters>, ...}}"
            )
    return tools or None


def message_from_proto(m: common_pb2.ChatMessage, name: str) -> dict[str, Any]:
    """A chat message as chat templates read it (OpenAI's form; ``tool_calls``,
    ``tool_call_id`` and ``name`` only when set: some templates branch on the key's presence)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if len(m.tool_calls) > MAX_CALLS:
            raise InvalidRequest(f"{name}.tool_calls: {len(m.tool_calls)} calls; at most {MAX_CALLS}")
        out["tool_calls"] = [
            _call_from_proto(c, f"{name}.tool_calls[{i}]") for i, c in enumerate(m.tool_calls)
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _call_from_proto(c: common_pb2.ToolCall, name: str) -> dict[str, Any]:
    if not 0 < len(c.name) <= MAX_NAME_CHARS or len(c.id) > MAX_TOOL_CALL_ID_CHARS:
        raise InvalidRequest(
            f"{name}: name takes 1 to {MAX_NAME_CHARS} characters, id at most {MAX_TOOL_CALL_ID_CHARS}"
        )
    try:
        args = json.loads(c.arguments_json or "{}")
    except (ValueError, RecursionError):
        args = None
    if not isinstance(args, dict):
        raise InvalidRequest(
            f"{name}.arguments_json must be a JSON object, got {bounded(c.arguments_json, 80)!r}"
        )
    return openai_tool_call(c.id, c.name, args)


def messages_chars(messages: Sequence[common_pb2.ChatMessage], tools_json: str = "") -> int:
    """Characters of a dialogue (what max_prompt_chars bounds): text, names, ids, arguments."""
    calls = (c for m in messages for c in m.tool_calls)
    return (
        sum(len(m.role) + len(m.content) + len(m.tool_call_id) + len(m.name) for m in messages)
        + sum(len(c.id) + len(c.name) + len(c.arguments_json) for c in calls)
        + len(tools_json)
    )


def continuation_from_proto(
    c: common_pb2.Continuation, max_model_len: int, max_chars: int, name: str
) -> tuple[list[int], list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(prefix ids, messages to append, tools)`` of a Continuation, within bounds: the prefix
    shorter than the context, at most ``MAX_APPEND`` messages, tool turns then at most one user
    turn, ``max_chars`` characters in all."""
    if not c.prefix_token_ids:
        raise InvalidRequest(f"{name}: continuation.prefix_token_ids is empty")
    # Checked before the ids are copied or scanned (as a token_ids prompt's length).
    if (n := len(c.prefix_token_ids)) >= max_model_len:
        raise InvalidRequest(
            f"{name}: continuation prefix has {n} tokens; the model takes at most {max_model_len - 1}"
        )
    if len(c.append) > MAX_APPEND:
        raise InvalidRequest(
            f"{name}: continuation.append has {len(c.append)} messages; at most {MAX_APPEND}"
        )
    if (size := messages_chars(c.append, c.tools_json)) > max_chars:
        raise InvalidRequest(
            f"{name}: continuation has {size} characters; at most {max_chars} (max_prompt_chars)"
        )
    if any(m.tool_calls for m in c.append):
        raise InvalidRequest(
            f"{name}: continuation.append holds tool and user turns, which carry no tool_calls"
        )
    append = [message_from_proto(m, f"{name}: continuation.append[{i}]") for i, m in enumerate(c.append)]
    try:
        check_append(append)
    except InvalidRequest as e:
        raise InvalidRequest(f"{name}: {e}") from None
    return list(c.prefix_token_ids), append, tools_from_json(c.tools_json, f"{name}: continuation.tools_json")


def tool_call_to_proto(c: ParsedCall) -> common_pb2.ToolCall:
    return common_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json, parse=int(c.parse))


def check_to_proto(r: ChatCheck) -> generator_pb2.CheckChatResponse:
    return generator_pb2.CheckChatResponse(
        tools_missing_from_prompt=r.tools_missing_from_prompt,
        round_trip_ok=r.round_trip_ok,
        round_trip_detail=bounded(r.round_trip_detail),
        prefix_preserving=r.prefix_preserving,
        bridge_detail=bounded(r.bridge_detail),
        glue_token_ids=r.glue_token_ids,
        stop_token_ids=r.stop_token_ids,
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
        tool_calls=[tool_call_to_proto(c) for c in s.tool_calls],
        content=s.content,
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
        if r.ipc.push_id >= 1 << 63:
            raise InvalidRequest("ipc.push_id must be below 2^63")
        if r.ipc.push_id and not shm.valid_name(r.ipc.ready_segment):
            raise InvalidRequest(
                f"ipc.ready_segment {bounded(r.ipc.ready_segment, 140)!r} is not a relayrl segment name"
            )
        return BucketSource(
            ipc=tuple(shared_from_proto(b) for b in r.ipc.buffers),
            ipc_push_id=r.ipc.push_id,
            ipc_ready_segment=r.ipc.ready_segment if r.ipc.push_id else "",
        )
    return None


def adapter_from_proto(a: generator_pb2.LoraAdapter) -> AdapterSpec:
    """``UpdateWeightsRequest.lora``, checked (INVALID_ARGUMENT naming the field).

    >>> adapter_from_proto(generator_pb2.LoraAdapter(rank=8, alpha=16, target_modules=["q_proj"]))
    AdapterSpec(rank=8, alpha=16.0, target_modules=('q_proj',))
    >>> adapter_from_proto(generator_pb2.LoraAdapter(rank=8, alpha=16))
    Traceback (most recent call last):
    ...
    relayrl.common.rpc.InvalidRequest: lora.target_modules must name 1 to 64 modules
    """
    spec = AdapterSpec(a.rank, a.alpha, tuple(a.target_modules[: MAX_TARGETS + 1]))
    if why := spec.problem():
        raise InvalidRequest(why)
    return spec
