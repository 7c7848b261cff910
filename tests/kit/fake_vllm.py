"""A generator replica on a fake vLLM, for tests of weight sync on CPU in one process: the
real servicer, ``VLLMEngine`` (weight swaps) and worker extension, with ``FakeLLM`` running each
``collective_rpc`` on a ``FakeWorker`` in a thread, as vLLM runs it in its EngineCore, and
raising a failure as vLLM does (a bare message). The worker's reload behaves as vLLM's layerwise
reload does where it matters here: each tensor reaches the model as it is yielded, and an
exception out of the weights iterator or the loader leaves the reload half set up, so every
later reload fails ("meta tensors") until that reload is finished."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from types import SimpleNamespace

import torch
from relayrl.common.grpc_server import start
from relayrl.common.weightsync.buckets import dtype_name
from relayrl.common.weightsync.plan import Bucket, TensorMeta, plan_buckets
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.server import build
from relayrl.generator.v1 import generator_pb2_grpc
from relayrl.generator.vllm_engine import VLLMEngine
from relayrl.generator.worker_ext import WeightSyncExtension

from tests.kit.serving import client

SHAPES = {"a.weight": (16,), "b.weight": (40, 4), "c.weight": (3, 4)}
BUCKET = 256  # bytes: a, b and c travel in three buckets


class FakeWorker(WeightSyncExtension):
    def __init__(self, model: torch.nn.Module):
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.params = dict(model.named_parameters())
        self.half_set_up = False  # a reload was left open: vLLM's parameters sit on "meta"
        self.loader_fails_at: str | None = None

    def reload_weights(self, weights_iterator):
        if self.half_set_up:
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")
        self.half_set_up = True
        with torch.no_grad():
            for name, t in weights_iterator:
                if name == self.loader_fails_at:
                    raise RuntimeError(f"{name}: the loader failed")
                self.params[name].copy_(t)
        self.half_set_up = False

    def _relayrl_finish_reload(self) -> None:  # what vLLM's finalize_layerwise_reload does here
        self.half_set_up = False

    def _relayrl_refresh_tied(self) -> None:
        pass


class FakeLLM:
    errored = False

    def __init__(self, worker: FakeWorker):
        self.worker = worker
        self.busy = threading.Lock()  # the EngineCore runs one call at a time, to its end

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        def call():
            with self.busy:
                try:
                    return [getattr(self.worker, method)(*args)]
                except Exception as e:  # as vLLM hands a worker's failure back
                    raise Exception(f"Call to collective_rpc method failed: {e}") from None

        return await asyncio.to_thread(call)

    async def pause_generation(self, mode="abort", clear_cache=True):
        pass

    async def resume_generation(self):
        pass

    async def reset_prefix_cache(self):
        pass

    def shutdown(self):
        pass


def _model() -> torch.nn.Module:
    m = torch.nn.Module()
    for name, shape in SHAPES.items():
        sub = torch.nn.Module()
        sub.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        m.add_module(name.split(".")[0], sub)
    return m


def _checkpoint(folder) -> str:
    from safetensors.torch import save_file

    save_file({n: torch.zeros(s) for n, s in SHAPES.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({}))
    return str(folder)


def weights(seed: float, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        n: torch.full(s, seed).to(dtype) + torch.arange(torch.Size(s).numel()).view(s).to(dtype)
        for n, s in SHAPES.items()
    }


def plan(tensors: dict[str, torch.Tensor]) -> list[Bucket]:
    metas = [TensorMeta(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    return plan_buckets(metas, BUCKET)


@contextlib.asynccontextmanager
async def replica(folder, replica_id: str = "gen-t"):
    """A generator server on port 0: the real servicer and engine on a ``FakeLLM``; yields a
    ``kit.serving.client`` with ``engine``, ``worker``, ``params`` and ``address`` besides."""
    model = _model()
    engine = VLLMEngine(GeneratorConfig(engine={"model": _checkpoint(folder)}), replica_id)
    worker = FakeWorker(model)
    engine._llm = FakeLLM(worker)
    handle = build(engine, GeneratorConfig())
    await start(handle, ready=True)
    extra = dict(engine=engine, worker=worker, params=worker.params, address=f"127.0.0.1:{handle.port}")
    try:
        async with client(handle, generator_pb2_grpc.GeneratorServiceStub, **extra) as r:
            yield r
    finally:
        await handle.stop(0)
