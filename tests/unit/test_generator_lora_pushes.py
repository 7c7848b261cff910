"""LoRA adapter pushes through the generator's real code (servicer, ``VLLMEngine``'s weight swaps,
the worker extension writing the adapter's folder) on a fake vLLM whose LoRA manager behaves as
vLLM's does where it matters (``FakeLoRAs``).

What is checked (issue 39, LoRA pushes under attack): an adapter is checked against the base
model's layers before anything is staged (a tensor smaller or larger than its layer, a layer the
model lacks, a dtype that is no float: INVALID_ARGUMENT naming the tensor, in a bounded message,
nothing written, nothing handed to vLLM); a failed push leaves no trace on its version, so a
later valid push of the same version loads and serves its own bytes.
"""

from __future__ import annotations

import contextlib
import json
import re

import grpc
import pytest
import torch
from relayrl.common.grpc_server import start
from relayrl.common.weightsync.buckets import dtype_name
from relayrl.common.weightsync.plan import TensorMeta, plan_buckets
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.server import build
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc
from relayrl.generator.vllm_engine import VLLMEngine

from tests.kit.fake_vllm import FakeLLM, FakeWorker
from tests.kit.serving import client
from tests.kit.shm_push import Staging, open_shm
from tests.kit.waits import error_of

LAYERS = {  # the base model's linear layers: module -> (out_features, in_features)
    "model.layers.0.self_attn.q_proj": (32, 16),
    "model.layers.0.self_attn.v_proj": (8, 16),
    "model.layers.0.mlp.down_proj": (16, 24),
}
RANK = 4
TARGETS = ("q_proj", "v_proj", "down_proj")
NAME = "base_model.model.{}.lora_{}.weight"
_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


class FakeLoRAs:
    """vLLM's worker LoRA manager (``LRUCacheWorkerLoRAManager`` with one slot) where it matters
    here, as read in vllm/lora/worker_manager.py and model_manager.py: adapters are cached by
    their int id, and an id it holds is answered from the cache without reading the folder;
    activation takes the slot before it copies the adapter's tensors into LoRA buffers of each
    layer's size (a larger tensor fails there, the adapter left registered; a smaller one is
    zero-padded); tensors of modules the model lacks are skipped. ``add_lora`` and each request
    (``run``) load or activate their adapter the same way."""

    def __init__(self):
        self.registered: dict[int, dict[str, torch.Tensor]] = {}
        self.active: int | None = None
        self.fail_next = False  # the next adapter loaded fails at activation, every time
        self._failing: set[int] = set()

    async def add_lora(self, req) -> bool:
        self.run(req)
        return True

    def run(self, req) -> dict[str, torch.Tensor]:
        """What a request with ``req`` runs with (vLLM activates a request's adapter first)."""
        from safetensors.torch import load_file

        if req.lora_int_id not in self.registered:
            self.registered[req.lora_int_id] = load_file(f"{req.lora_path}/adapter_model.safetensors")
            if self.fail_next:
                self._failing.add(req.lora_int_id)
                self.fail_next = False
        if self.active != req.lora_int_id:
            self._activate(req.lora_int_id)
        return self.registered[req.lora_int_id]

    def _activate(self, lora_id: int) -> None:
        self.active = lora_id  # vLLM marks the slot taken before filling it
        if lora_id in self._failing:
            raise RuntimeError("the adapter could not be copied into its slot")
        for name, t in self.registered[lora_id].items():
            module, half = _TENSOR.fullmatch(name).groups()
            if module not in LAYERS:
                continue
            out_f, in_f = LAYERS[module]
            buf = torch.zeros((8, in_f) if half == "A" else (out_f, 8))
            buf[: t.shape[0], : t.shape[1]].copy_(t)  # raises for a larger tensor, pads a smaller one

    async def remove_lora(self, lora_id: int) -> bool:
        if self.active == lora_id:
            self.active = None
        return self.registered.pop(lora_id, None) is not None


class LoraLLM(FakeLLM):
    def __init__(self, worker: FakeWorker):
        super().__init__(worker)
        self.loras = FakeLoRAs()
        self.add_lora, self.remove_lora = self.loras.add_lora, self.loras.remove_lora


def _checkpoint(folder) -> str:
    from safetensors.torch import save_file

    shapes = {f"{m}.weight": s for m, s in LAYERS.items()} | {"model.norm.weight": (16,)}
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({}))
    return str(folder)


@contextlib.asynccontextmanager
async def lora_replica(tmp_path):
    """A generator server on port 0 taking adapters up to rank 8 (the real servicer and engine
    on a ``LoraLLM``), its weight sync open over shared memory; yields a ``kit.serving.client``
    with ``engine``, ``loras`` (vLLM's LoRA cache) and ``root`` (where adapters are written)."""
    model_dir, root = tmp_path / "model", tmp_path / "adapters"
    model_dir.mkdir()
    root.mkdir()
    config = GeneratorConfig(engine={"model": _checkpoint(model_dir), "max_lora_rank": 8})
    engine = VLLMEngine(config, "gen-lora")
    engine._llm = LoraLLM(FakeWorker(torch.nn.Linear(1, 1)))
    engine._adapter_root = str(root)  # what start() makes: a private temporary folder
    handle = build(engine, GeneratorConfig())
    await start(handle, ready=True)
    try:
        extra = dict(engine=engine, loras=engine._llm.loras, root=root)
        async with client(handle, generator_pb2_grpc.GeneratorServiceStub, **extra) as r:
            await open_shm(r.stub)
            yield r
    finally:
        await handle.stop(0)


def adapter(seed: int, dtype=torch.float32, **shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A rank-``RANK`` adapter of every layer; ``shapes``: a tensor's (as "q_proj_B") instead of
    the one its layer takes."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, (out_f, in_f) in LAYERS.items():
        leaf = module.rsplit(".", 1)[1]
        for half, shape in (("A", (RANK, in_f)), ("B", (out_f, RANK))):
            shape = shapes.get(f"{leaf}_{half}", shape)
            out[NAME.format(module, half)] = torch.randn(shape, generator=gen).to(dtype)
    return out


async def push(r, version: int, tensors: dict[str, torch.Tensor], push_id: int):
    """UpdateWeights of ``tensors`` as a rank-``RANK`` adapter of ``TARGETS``, over shared memory."""
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    staging = Staging(plan_buckets(metas, 1 << 12))
    try:
        staging.fill(tensors, push_id)
        req = staging.request(version, push_id)
        req.lora.CopyFrom(g.LoraAdapter(rank=RANK, alpha=8.0, target_modules=TARGETS))
        return await r.stub.UpdateWeights(req)
    finally:
        staging.seg.close()


async def status(r) -> g.GetStatusResponse:
    return await r.stub.GetStatus(g.GetStatusRequest())


def served(r, tensors: dict[str, torch.Tensor]) -> bool:
    """A request runs with exactly ``tensors`` (the adapter the engine gives every request, as
    vLLM resolves its id)."""
    got = r.loras.run(r.engine._lora)
    return got.keys() == tensors.keys() and all(torch.equal(got[n], t) for n, t in tensors.items())


def folders(r) -> list[str]:
    return sorted(p.name for p in r.root.iterdir())


async def test_an_adapter_that_fits_is_served(tmp_path):
    async with lora_replica(tmp_path) as r:
        good = adapter(1)
        assert (await push(r, 1, good, push_id=1)).version == 1
        st = await status(r)
        assert (st.policy_version, st.ready, st.serving_lora) == (1, True, True) and served(r, good)


async def test_a_failed_push_of_a_version_leaves_no_trace_on_it(tmp_path):
    """The 3-push repro: an adapter whose q_proj lora_B is larger than the layer, under version
    2, then a valid one under 2, then that valid push again. Before: the first reached vLLM,
    which registered it under id 2 and failed filling its slot; the second was answered from
    vLLM's cache by id (the failed adapter served, or its error again), never read."""
    async with lora_replica(tmp_path) as r:
        first = adapter(1)
        await push(r, 1, first, push_id=1)
        err = await error_of(push(r, 2, adapter(2, q_proj_B=(40, RANK)), push_id=2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        st = await status(r)
        assert (st.policy_version, st.ready) == (1, True) and served(r, first)

        good = adapter(3)
        resp = await push(r, 2, good, push_id=3)
        assert resp.version == 2 and (await status(r)).policy_version == 2
        assert served(r, good), "the second push of version 2 serves the first one's adapter"
        again = await push(r, 2, good, push_id=4)  # a retry of the push served: answered as done
        assert (again.version, list(again.bucket_checksums)) == (2, list(resp.bucket_checksums))
        assert served(r, good) and len(r.loras.registered) == 1 and len(folders(r)) == 1
        # refused before staging, naming the tensor (it never reached vLLM)
        assert "q_proj.lora_B.weight: shape [40, 4], the layer takes [32, 4]" in err.details()


async def test_an_adapter_vllm_fails_on_after_registering_it_leaves_no_trace_on_its_version(tmp_path):
    """The cause, apart from the checks: a push that fits the model but fails inside vLLM after
    vLLM registered it (here its slot cannot be filled). vLLM's LoRA cache is keyed by the
    adapter's int id, and the version was that id: the next push of the version was answered
    with the failed adapter. Now each push gets an id vLLM never saw, and a failed one is
    removed from vLLM and from disk."""
    async with lora_replica(tmp_path) as r:
        first = adapter(1)
        await push(r, 1, first, push_id=1)
        r.loras.fail_next = True
        err = await error_of(push(r, 2, adapter(2), push_id=2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "vLLM refused" in err.details()
        assert (await status(r)).policy_version == 1 and served(r, first)

        good = adapter(3)
        assert (await push(r, 2, good, push_id=3)).version == 2
        assert served(r, good), "vLLM's cache answered the second push with the failed one"
        assert (await push(r, 3, adapter(4), push_id=4)).version == 3 and served(r, adapter(4))
        assert len(r.loras.registered) == 1 and len(folders(r)) == 1  # nothing of the failed push


BAD = {  # an adapter wrong in one way -> words the refusal must carry
    "a lora_B smaller than its layer": (
        dict(tensors=adapter(5, q_proj_B=(24, RANK))),
        "self_attn.q_proj.lora_B.weight: shape [24, 4], the layer takes [32, 4]",
    ),
    "a lora_A narrower than its layer": (
        dict(tensors=adapter(5, down_proj_A=(RANK, 16))),
        "mlp.down_proj.lora_A.weight: shape [4, 16], the layer takes [4, 24]",
    ),
    "a layer the model lacks": (
        dict(extra="model.layers.7.self_attn.q_proj"),
        "lora_A.weight: the model has no layer model.layers.7.self_attn.q_proj",
    ),
    "integer tensors": (
        dict(tensors=adapter(5, dtype=torch.int64)),
        "v_proj.lora_A.weight: dtype int64, not a float",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_an_adapter_that_does_not_fit_the_model_is_refused_before_anything_is_staged(tmp_path, case):
    """Before: the smaller tensors were zero-padded by vLLM and served, the unknown layer's
    tensors skipped and the rest served (integer tensors were refused already). Now each is
    refused naming the tensor, nothing is written or handed to vLLM, and the adapter served
    before stays."""
    fields, words = BAD[case]
    tensors = fields.get("tensors") or adapter(5)
    if "extra" in fields:
        tensors |= {
            NAME.format(fields["extra"], h): torch.ones(s) for h, s in (("A", (RANK, 16)), ("B", (32, RANK)))
        }
    async with lora_replica(tmp_path) as r:
        first = adapter(1)
        await push(r, 1, first, push_id=1)
        err = await error_of(push(r, 2, tensors, push_id=2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()
        st = await status(r)
        assert (st.policy_version, st.ready, st.serving_lora) == (1, True, True) and served(r, first)
        assert len(r.loras.registered) == 1 and len(folders(r)) == 1


async def test_a_refusal_of_many_bad_tensors_with_long_names_stays_short(tmp_path):
    layer = "model.layers.0." + "x" * 5000 + ".q_proj"
    tensors = {NAME.format(f"{layer}{i}", "A"): torch.zeros(RANK, 16) for i in range(50)}
    async with lora_replica(tmp_path) as r:
        err = await error_of(push(r, 1, tensors, push_id=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(err.details()) <= 2000 and err.details().startswith("adapter does not fit the model: ")
    assert "base_model.model.model.layers.0.xxx" in err.details() and "more" in err.details()
