"""What the learner refuses before any rank does anything: training values no sampler or
advantage estimator produces, and checkpoint state that could not be given back. Rank 0's real
servicer and core, on a real gRPC server, over a trainer and a control channel that record what
reaches them (no DeepSpeed: a refusal must come before the ranks are involved)."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import grpc
import pytest
from relayrl.common.grpc_server import create_server, start
from relayrl.common.rpc import InvalidRequest
from relayrl.learner.config import LearnerConfig
from relayrl.learner.core import MAX_CLIENT_STATE_CHARS, LearnerCore
from relayrl.learner.samples import decode_samples
from relayrl.learner.servicer import LearnerServicer
from relayrl.learner.v1 import learner_pb2 as lp
from relayrl.learner.v1 import learner_pb2_grpc as lg


class Recorder:
    """A control channel that records the commands rank 0 would send to the other ranks."""

    def __init__(self):
        self.sent = []

    def send(self, cmd, payload=b""):
        self.sent.append(cmd)

    def gather_text(self, text, limit=512):
        return [text]


def fake_trainer(role="actor"):
    return SimpleNamespace(
        cfg=LearnerConfig(role=role),
        vocab_size=100,
        max_len=512,
        step=0,
        version=0,
        problem=lambda *a: "",
        save=lambda path, tag, state: None,
    )


@contextlib.asynccontextmanager
async def learner(tmp_path, role="actor"):
    control = Recorder()
    core = LearnerCore(fake_trainer(role), control)
    servicer = LearnerServicer(core, sync=None, bucket_bytes=1, max_tokens=0, checkpoint_dir=tmp_path)
    handle = create_server(servicer, lp.DESCRIPTOR.services_by_name["LearnerService"])
    await start(handle, ready=True)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield lg.LearnerServiceStub(ch), control
    finally:
        await ch.close()
        await handle.stop(0)


def sample(**kw) -> lp.TrainSample:
    fields = dict(prompt_token_ids=[5], completion_token_ids=[6, 7], generator_logprobs=[-1.0, -2.0])
    return lp.TrainSample(**{**fields, **kw})


@pytest.mark.parametrize(
    "bad, needle",
    [
        (sample(generator_logprobs=[-1.0, -1e30]), "samples[1]: generator_logprobs[1] is -1e+30"),
        (sample(generator_logprobs=[float("nan"), -1.0]), "samples[1]: generator_logprobs[0] is nan"),
        (sample(generator_logprobs=[-float("inf"), -1.0]), "samples[1]: generator_logprobs[0] is -inf"),
        (sample(generator_logprobs=[-1.0, 0.5]), "samples[1]: generator_logprobs[1] is 0.5"),
        (sample(token_advantages=[1.0, 3e38]), "samples[1]: token_advantages[1] is 3e+38"),
        (sample(advantage=float("inf")), "samples[1]: advantage is inf"),
    ],
)
async def test_absurd_training_values_are_refused_naming_sample_field_and_token(tmp_path, bad, needle):
    async with learner(tmp_path) as (stub, control):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.TrainStep(lp.TrainStepRequest(step=1, samples=[sample(), bad]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()
    assert control.sent == []  # refused on rank 0: no rank started the step


@pytest.mark.parametrize("field", ["returns", "values"])
def test_a_critics_absurd_returns_and_values_are_refused(field):
    good = {"returns": [0.5, 1.0], "values": [0.1, 0.2]}
    req = lp.TrainStepRequest(step=1, samples=[sample(**{**good, field: [1.0, float("nan")]})])
    with pytest.raises(InvalidRequest, match=rf"samples\[0\]: {field}\[1\] is nan"):
        decode_samples(req, 100, 512, LearnerConfig(role="critic"))


def test_the_least_likely_real_log_probabilities_still_train():
    req = lp.TrainStepRequest(step=1, samples=[sample(generator_logprobs=[-1000.0, -0.0])])
    assert decode_samples(req, 100, 512, LearnerConfig())[0].behavior_logprobs == [-1000.0, 0.0]


@pytest.mark.parametrize(
    "state, needle",
    [
        ("{step: 3}", "client_state_json is not JSON"),
        ('{"kl_coef": NaN}', "client_state_json is not JSON: NaN is not JSON"),
        ("[" * 100_000, "client_state_json is not JSON"),
        (json.dumps("x" * MAX_CLIENT_STATE_CHARS), f"at most {MAX_CLIENT_STATE_CHARS}"),
    ],
)
async def test_checkpoint_state_that_could_not_be_given_back_is_refused(tmp_path, state, needle):
    async with learner(tmp_path) as (stub, control):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SaveCheckpoint(lp.SaveCheckpointRequest(tag="s1", client_state_json=state), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
    assert control.sent == []


async def test_json_state_is_saved(tmp_path):
    async with learner(tmp_path) as (stub, control):
        state = json.dumps({"step": 3, "epoch": 0, "index": 12, "kl_coef": 0.1})
        resp = await stub.SaveCheckpoint(
            lp.SaveCheckpointRequest(tag="s1", client_state_json=state), timeout=10
        )
    assert resp.tag == "s1" and [c["op"] for c in control.sent] == ["check", "save"]
    assert control.sent[1]["state"] == state
