"""The gRPC contracts: generated code is fresh, light to import, documented, and works on the wire.

The .proto files under protos/ are the API reference; the code under services/<svc>/v1/ is
generated from them by scripts/gen_protos.py and must match a fresh run byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from relayrl.common.v1 import common_pb2
from relayrl.reward.v1 import reward_pb2, reward_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = ROOT / "scripts" / "gen_protos.py"
SERVICES = ("common", "generator", "learner", "reward", "coordinator", "env", "gateway")
HEAVY = {"torch", "vllm", "deepspeed", "transformers"}


def _generated_modules() -> list[str]:
    """Dotted names of every generated *_pb2 and *_pb2_grpc module under services/<svc>/v1."""
    return sorted(
        f"relayrl.{p.parent.parent.name}.{p.parent.name}.{p.stem}"
        for p in (ROOT / "services").glob("*/v[0-9]*/*_pb2*.py")
    )


def _run_gen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN_SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) is needed to regenerate the code")
    result = _run_gen("--check")
    assert result.returncode == 0, result.stderr


def test_generated_modules_import_without_heavy_packages() -> None:
    modules = _generated_modules()
    assert len(modules) == 2 * len(SERVICES), modules
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = {n.split('.')[0] for n, m in sys.modules.items() if m is not None}\n"
        f"print(json.dumps(sorted(loaded & set({sorted(HEAVY)!r}))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def _undocumented(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Elements of a .proto without a leading comment, as "file: kind full.name"."""
    comments = {tuple(loc.path): loc.leading_comments.strip() for loc in file.source_code_info.location}
    missing: list[str] = []

    def need(path: tuple[int, ...], kind: str, name: str) -> None:
        if not comments.get(path):
            missing.append(f"{file.name}: {kind} {name}")

    def enum(e: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], prefix: str) -> None:
        need(path, "enum", prefix + e.name)
        for i, v in enumerate(e.value):
            need((*path, 2, i), "enum value", f"{prefix}{e.name}.{v.name}")

    def message(m: descriptor_pb2.DescriptorProto, path: tuple[int, ...], prefix: str) -> None:
        if m.options.map_entry:  # synthetic type of a map<,> field; the field carries the comment
            return
        name = prefix + m.name
        need(path, "message", name)
        for i, f in enumerate(m.field):
            need((*path, 2, i), "field", f"{name}.{f.name}")
        for i, o in enumerate(m.oneof_decl):
            members = [f for f in m.field if f.HasField("oneof_index") and f.oneof_index == i]
            if not all(f.proto3_optional for f in members):  # skip the synthetic oneof of `optional`
                need((*path, 8, i), "oneof", f"{name}.{o.name}")
        for i, nested in enumerate(m.nested_type):
            message(nested, (*path, 3, i), name + ".")
        for i, e in enumerate(m.enum_type):
            enum(e, (*path, 4, i), name + ".")

    prefix = file.package + "."
    for i, m in enumerate(file.message_type):
        message(m, (4, i), prefix)
    for i, e in enumerate(file.enum_type):
        enum(e, (5, i), prefix)
    for i, s in enumerate(file.service):
        need((6, i), "service", prefix + s.name)
        for j, rpc in enumerate(s.method):
            need((6, i, 2, j), "rpc", f"{prefix}{s.name}.{rpc.name}")
    return missing


def test_every_element_is_documented(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) is needed to read .proto comments")
    out = tmp_path / "relayrl.protoset"
    result = _run_gen("--descriptor-set-out", str(out))
    assert out.exists(), result.stderr
    files = [
        f
        for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
        if f.name.startswith("relayrl/")
    ]
    assert sorted(f.package for f in files) == sorted(f"relayrl.{s}.v1" for s in SERVICES)
    missing = [line for f in files for line in _undocumented(f)]
    assert not missing, "undocumented in the .proto:\n" + "\n".join(missing)


def test_sample_and_tensor_round_trip() -> None:
    sample = common_pb2.Sample(
        prompt_id="p0",
        sample_index=3,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[7, 8, 9, 2],
        logprobs=[-0.5, -1.25, -0.0, -3.0],
        finish_reason=common_pb2.FINISH_REASON_STOP,
        policy_version=4,
        version_spans=[
            common_pb2.VersionSpan(version=4, start=0, end=2),
            common_pb2.VersionSpan(version=5, start=2, end=4),
        ],
        replica_id="gen-0",
        text="(3 + 5) * 3",
    )
    back = common_pb2.Sample.FromString(sample.SerializeToString())
    assert back == sample
    assert list(back.logprobs) == [-0.5, -1.25, -0.0, -3.0]
    assert [(s.version, s.start, s.end) for s in back.version_spans] == [(4, 0, 2), (5, 2, 4)]

    array = np.arange(6, dtype="<f4").reshape(2, 3) / 7
    tensor = common_pb2.Tensor(
        name="model.layers.0.mlp.up_proj.weight",
        data=np.ascontiguousarray(array).tobytes(),
        dtype=common_pb2.DTYPE_FLOAT32,
        shape=array.shape,
    )
    parsed = common_pb2.Tensor.FromString(tensor.SerializeToString())
    assert parsed.dtype == common_pb2.DTYPE_FLOAT32
    np.testing.assert_array_equal(np.frombuffer(parsed.data, dtype="<f4").reshape(tuple(parsed.shape)), array)

    prompt = common_pb2.Prompt(prompt_id="p0", token_ids=common_pb2.TokenIds(ids=[1, 2]))
    assert common_pb2.Prompt.FromString(prompt.SerializeToString()).WhichOneof("input") == "token_ids"


class _ExactMatchReward(reward_pb2_grpc.RewardServiceServicer):
    """Reward 1 when the completion equals the ground truth; request_id "slow" never answers."""

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        if request.request_id == "slow":
            await asyncio.sleep(30)
        return reward_pb2.ScoreResponse(
            results=[
                reward_pb2.RewardResult(
                    sample_id=item.sample_id,
                    reward=float(item.completion == item.ground_truth),
                    components={"correctness": float(item.completion == item.ground_truth)},
                    status=reward_pb2.SCORE_STATUS_OK,
                )
                for item in request.items
            ]
        )


@pytest.fixture
async def reward_stub():
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(_ExactMatchReward(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield reward_pb2_grpc.RewardServiceStub(channel)
    finally:
        await server.stop(None)


async def test_score_over_grpc(reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    request = reward_pb2.ScoreRequest(
        request_id="r1",
        items=[
            reward_pb2.RewardInput(sample_id="a", completion="24", ground_truth="24", data_source="toy"),
            reward_pb2.RewardInput(sample_id="b", completion="23", ground_truth="24", data_source="toy"),
        ],
    )
    response = await reward_stub.Score(request, timeout=10)
    assert [(r.sample_id, r.reward, r.status) for r in response.results] == [
        ("a", 1.0, reward_pb2.SCORE_STATUS_OK),
        ("b", 0.0, reward_pb2.SCORE_STATUS_OK),
    ]
    assert dict(response.results[0].components) == {"correctness": 1.0}


async def test_deadline_reaches_the_client(reward_stub: reward_pb2_grpc.RewardServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await reward_stub.Score(reward_pb2.ScoreRequest(request_id="slow"), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
