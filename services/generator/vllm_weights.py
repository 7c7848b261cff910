"""Weight swaps of ``VLLMEngine``: the open weight sync, updates over it, loads over gRPC.

Flow: ``open_weight_sync`` (join the learner's group, or read its shared-memory or CUDA IPC
probe) -> ``update_weights`` (repeatedly) -> ``close_weight_sync``; ``load_weights`` takes tensors
sent as bytes. The worker extension (``worker_ext.py``) receives and loads inside vLLM's workers
and answers an ``outcome``; this module turns it into the engine's state and a status code.

What a replica serves is never part of two versions without saying so: a load that had handed
vLLM any tensor when it failed leaves the weights of no known version, and the replica stops
being ready until a complete load succeeds. A load refused before its first tensor (a bad
request, a segment that is not one, a push given up before its first bucket) changes nothing:
the replica stays ready, at its version.

A LoRA adapter push (``lora``) never touches the model: its tensors are checked against the base
model's layers before any byte arrives (``common/weightsync/adapters.py``: names, exact shapes for
its rank, dtypes), the workers write the adapter's folder, and only once it is whole is it loaded
through vLLM's LoRA API (``add_lora``) and made the adapter every request runs with, under the
pushed version. A push that fails or stops half-way, or an adapter vLLM refuses, leaves the
previous adapter serving and no trace of itself: its folder is removed, and vLLM never sees its
adapter id again (``_LORA_IDS``), so a later push of the same version loads its own bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import time
from dataclasses import asdict, dataclass

from relayrl.common.rpc import DataLoss, FailedPrecondition, InvalidRequest, ServiceError, Unavailable
from relayrl.common.weightsync.adapters import AdapterSpec, adapter_layers, adapter_problems, summary
from relayrl.common.weightsync.buckets import from_bytes, non_finite
from relayrl.common.weightsync.plan import Bucket, TensorMeta, check_plan, plan_to_plain
from relayrl.generator.engine import BucketSource, SyncSpec, within

logger = logging.getLogger(__name__)

ENGINE_CALL_S = 60.0
"""Longest wait for a control call into vLLM (pause, resume, cache reset, leaving a group): they
take milliseconds, or never end when the EngineCore is dead (``died`` reports that)."""


class Worker:
    """Names of the methods of ``worker_ext.WeightSyncExtension`` this engine calls in vLLM's
    workers. ``collective_rpc`` takes a method's name (a string crosses into the EngineCore;
    a function would have to be pickled), so every name is spelled here once, and
    ``tests/unit/test_worker_methods.py`` checks that each is a method of the extension."""

    IDENTITY = "relayrl_identity"
    OPEN_GROUP = "relayrl_open_group"
    CLOSE_GROUP = "relayrl_close_group"
    PROBE_SHM = "relayrl_probe_shm"
    PROBE_IPC = "relayrl_probe_ipc"
    RECEIVE = "relayrl_receive"
    READ_SHM = "relayrl_read_shm"
    READ_IPC = "relayrl_read_ipc"
    LOAD_BYTES = "relayrl_load_bytes"


_STATUS = {"invalid": InvalidRequest, "data_loss": DataLoss, "unavailable": Unavailable}
_OPENINGS = itertools.count(1)
"""Ids of group openings in this process: a receive names the group its push was sent on."""
_LORA_IDS = itertools.count(1)
"""vLLM's ids of the adapters pushed in this process, one per push, never one twice. vLLM's LoRA
cache is keyed by this id and answers an id it holds from the cache, without reading the folder
named with it: an adapter that failed after vLLM registered it (a tensor larger than its layer
fails while being copied into the LoRA buffers) stayed there under its id, and every later push
under that id (the version, as it was) got the failed adapter again, or its error."""


@dataclass
class _Sync:
    """The open weight sync: its transport, and the ranks a group transport gave the workers."""

    transport: str
    rank: int = 0
    num_ranks: int = 0
    timeout_s: float = 300.0  # how long a pipelined push (shared memory, IPC) may wait for a bucket
    opening: int = 0  # a group's id in the workers: a receive takes only that group's broadcast


def combine(results: list[dict]) -> dict:
    """One answer for the replica from its workers' outcomes: any worker's error is the
    replica's, any touched model is the replica's, and the workers (tensor-parallel ranks, each
    sent every bucket) must agree on the checksums the first one speaks for.

    >>> ok = {"nbytes": 8, "checksums": [1], "kind": "", "error": "", "touched": True}
    >>> combine([ok, {**ok, "checksums": [2]}])["kind"]
    'data_loss'
    """
    first = results[0]
    failed = next((r for r in results if r["error"]), None)
    if failed is None and any(r["checksums"] != first["checksums"] for r in results):
        failed = {"kind": "data_loss", "error": "the replica's workers received different bytes"}
    return {
        **first,
        "kind": failed["kind"] if failed else "",
        "error": failed["error"] if failed else "",
        "touched": any(r["touched"] for r in results),
    }


class WeightSwaps:
    """The weight half of ``VLLMEngine`` (a mixin: it shares the engine's state)."""

    # The version last loaded by a push and the checksums of its bytes: a push of that version
    # again is a retry only if it carries the same bytes (a retried push that the first one
    # reached after all); other bytes under the same number are refused, never reported loaded.
    _held: tuple[int, list[int]] | None = None
    _lora = None  # the LoRARequest every request runs with (None: the base weights alone)
    _adapter_root = ""  # where pushed adapters are written (a private temporary folder)

    def _running(self) -> None:
        if self._llm is None or self._llm.errored:
            raise Unavailable("the vLLM engine is not running (starting, stopped or dead)")

    async def open_weight_sync(self, spec: SyncSpec) -> tuple[int, int]:
        self._running()
        if self._sync is not None:
            raise FailedPrecondition("weight sync is open already; close it first")
        if spec.transport in ("gloo", "nccl"):
            return await self._open_group(spec)
        try:  # every worker opens the probe: a transport that cannot work fails here, not at a push
            if spec.transport == "shm":
                args = (Worker.PROBE_SHM, (spec.shm_probe, spec.probe_checksum))
            else:
                args = (Worker.PROBE_IPC, (asdict(spec.ipc_probe), spec.probe_checksum))
            await within(self._llm.collective_rpc(args[0], args=args[1]), ENGINE_CALL_S, "reading the probe")
        except Exception as e:
            raise FailedPrecondition(f"{spec.transport} cannot reach this replica: {e}") from None
        self._sync = _Sync(spec.transport, timeout_s=spec.timeout_s)
        return 0, self._num_workers

    async def _open_group(self, spec: SyncSpec) -> tuple[int, int]:
        if spec.rank < 1 or spec.rank + self._num_workers > spec.world_size:
            raise InvalidRequest(
                f"rank {spec.rank} with {self._num_workers} worker(s) does not fit world_size "
                f"{spec.world_size} (rank 0 is the learner)"
            )
        if spec.transport == "nccl" and not self._gpu_uuids:
            raise FailedPrecondition("nccl needs GPUs; this replica runs on the CPU (use gloo)")
        args = (
            spec.master_addr,
            spec.master_port,
            spec.world_size,
            spec.rank,
            spec.transport,
            spec.timeout_s,
        )
        opening = next(_OPENINGS)
        join = self._llm.collective_rpc(Worker.OPEN_GROUP, args=(*args, spec.group_name, opening))
        try:  # the worker's join ends at the group's timeout; past that (and a margin) vLLM is stuck
            await within(join, spec.timeout_s + ENGINE_CALL_S, "joining the group")
        except Exception as e:  # the request was checked: what is left is the rendezvous failing
            raise Unavailable(
                f"could not join the {spec.transport} weight-sync group at {spec.master_addr}:{spec.master_port}: {e}"
            ) from None
        self._sync = _Sync(spec.transport, spec.rank, self._num_workers, opening=opening)
        return spec.rank, self._num_workers

    async def close_weight_sync(self) -> None:
        if self._sync is not None:
            transport, self._sync = self._sync.transport, None
            if transport in ("gloo", "nccl"):
                self._running()
                leave = self._llm.collective_rpc(Worker.CLOSE_GROUP)
                try:
                    await within(leave, ENGINE_CALL_S, "leaving the group")
                except Exception as e:  # closed here already; the worker leaves it at its next join
                    raise Unavailable(f"leaving the weight-sync group failed in vLLM: {e}") from None

    def _check_version(self, version: int) -> None:
        if version <= self.version:
            raise FailedPrecondition(f"version {version} is not newer than the replica's {self.version}")

    def _where(self, buckets: list[Bucket], source: BucketSource | None) -> tuple[str, tuple]:
        """The worker method that takes ``buckets`` over the open sync, and its arguments."""
        self._running()
        if self._sync is None:
            raise FailedPrecondition("weight sync is not open (InitWeightSync first)")
        transport = self._sync.transport
        if (transport in ("gloo", "nccl")) != (source is None):
            raise InvalidRequest(f"the open weight sync is {transport}: buckets must come over it")
        if source is None:
            # Named by the group open now: the receive may run later (behind a swap or vLLM's
            # pause), after the learner gave this push up and opened a new group for another.
            return Worker.RECEIVE, (self._sync.opening,)
        if transport == "shm" and source.shm_segment:
            if len(source.shm_offsets) != len(buckets):
                raise InvalidRequest(f"{len(source.shm_offsets)} shm offsets for {len(buckets)} buckets")
            ready = (source.shm_push_id, source.shm_ready_offset, self._sync.timeout_s)
            return Worker.READ_SHM, (source.shm_segment, list(source.shm_offsets), *ready)
        if transport == "ipc" and source.ipc:
            if len(source.ipc) != len(buckets):
                raise InvalidRequest(f"{len(source.ipc)} IPC buffers for {len(buckets)} buckets")
            if bad := [
                i for i, (s, b) in enumerate(zip(source.ipc, buckets, strict=True)) if s.nbytes != b.nbytes
            ]:
                raise InvalidRequest(
                    f"ipc.buffers[{bad[0]}] does not hold its bucket's {buckets[bad[0]].nbytes} bytes"
                )
            ready = (source.ipc_ready_segment, source.ipc_push_id, self._sync.timeout_s)
            return Worker.READ_IPC, ([asdict(x) for x in source.ipc], *ready)
        raise InvalidRequest(f"the open weight sync is {transport}: the request names no {transport} buffers")

    async def update_weights(
        self,
        version: int,
        buckets: list[Bucket],
        transport_only: bool = False,
        source: BucketSource | None = None,
        lora: AdapterSpec | None = None,
    ) -> tuple[int, float, list[int]]:
        """Take ``buckets`` over the open weight sync and switch to ``version`` (or, with
        ``transport_only``, take and discard them: the weights and version stay). Over a group
        the learner broadcasts them; over SHM or IPC ``source`` says where they are. With
        ``lora`` they are that adapter's tensors (see the module doc)."""
        method, where = self._where(buckets, source)
        plan = plan_to_plain(buckets)  # the form that crosses collective_rpc
        if transport_only:
            t0 = time.monotonic()
            got = self._answer(await self._rpc(method, (plan, *where, False)), version, loading=False)
            return got["nbytes"], time.monotonic() - t0, got["checksums"]
        refusal = self._refusal([t for b in buckets for t in b.tensors], lora)
        if refusal is not None:
            if self._sync.transport in ("gloo", "nccl"):  # drain: the learner must not be left blocked
                self._answer(await self._rpc(method, (plan, *where, False)), version, loading=False)
            raise refusal
        drain = (plan, *where, False)
        if lora is None:
            return await self._swap_in(version, method, (plan, *where, True), drain=drain)
        lora_id = next(_LORA_IDS)
        folder = f"{self._adapter_root}/v{version}.{lora_id}"
        adapter = {"folder": folder, "rank": lora.rank, "alpha": lora.alpha,
                   "target_modules": list(lora.target_modules), "base_model": self.config.engine.model}  # fmt: skip
        try:
            return await self._swap_in(
                version, method, (plan, *where, adapter), drain=drain, adapter=(version, lora_id, folder)
            )
        except BaseException:
            if self._lora is None or self._lora.lora_path != folder:  # not serving: leave no trace
                shutil.rmtree(folder, ignore_errors=True)
            raise

    def _refusal(self, metas: list[TensorMeta], lora: AdapterSpec | None) -> ServiceError | None:
        """Why a push of ``metas`` (an adapter's with ``lora``) cannot load here, or None."""
        if lora is None:
            problems = check_plan(metas, self._expected, self._optional, self._kinds)
            return (
                InvalidRequest("weight plan does not match the model: " + "; ".join(problems))
                if problems
                else None
            )
        have = self.config.engine.max_lora_rank
        if have < lora.rank:
            why = "runs without LoRA" if not have else f"takes LoRA ranks up to {have}"
            return FailedPrecondition(
                f"this replica {why} (generator engine.max_lora_rank); the adapter's rank is {lora.rank}"
            )
        if why := lora.problem():
            return InvalidRequest(why)
        # Against the base model's layers, from its checkpoint (read once at start): vLLM pads a
        # smaller tensor and skips an unknown layer, so only here is a wrong adapter refused whole.
        if problems := adapter_problems(lora, metas, adapter_layers(self._expected)):
            return InvalidRequest(f"adapter does not fit the model: {summary(problems)}"[:2000])
        return None

    async def _activate(self, version: int, lora_id: int, folder: str) -> None:
        """Load the adapter written in ``folder`` into vLLM (under ``lora_id``, new to it) and serve
        every later request with it; the previous one is unloaded and its folder removed. vLLM
        refusing it changes nothing: what it registered of it is removed again."""
        from vllm.lora.request import LoRARequest

        req = LoRARequest(f"relayrl-v{version}.{lora_id}", lora_id, folder)
        try:
            await within(self._llm.add_lora(req), ENGINE_CALL_S, "loading the adapter into vLLM")
        except Unavailable:  # no answer: vLLM is stuck or dead, and never asked for this id again
            raise
        except Exception as e:  # vLLM's own checks: modules it takes no LoRA on, ranks, ...
            await self._unload(req)  # it may have registered the adapter before failing
            raise InvalidRequest(f"vLLM refused the adapter of version {version}: {str(e)[:500]}") from None
        old, self._lora = self._lora, req
        if old is not None:
            await self._unload(old)

    async def _unload(self, req) -> None:
        try:
            await within(self._llm.remove_lora(req.lora_int_id), ENGINE_CALL_S, "unloading an adapter")
        except Exception as e:  # it stays in vLLM's cache until evicted: memory, not correctness
            logger.warning("could not unload adapter %s: %s", req.lora_name, e)
        shutil.rmtree(req.lora_path, ignore_errors=True)

    def check_tensor(self, meta: TensorMeta) -> None:
        """Refuse a tensor this model does not hold, or one of another shape or kind, before its
        bytes arrive: LoadWeights buffers a stream, which must not grow on names it will refuse."""
        expected = {meta.name: self._expected[meta.name]} if meta.name in self._expected else {}
        if problems := check_plan([meta], expected, self._optional, self._kinds):
            raise InvalidRequest("; ".join(problems))

    async def load_weights(
        self, version: int, items: list[tuple[str, str, list[int], bytes]]
    ) -> tuple[int, float, list[int]]:
        """Load tensors received over gRPC and switch to ``version``; the checksums are one per
        tensor, of the bytes loaded."""
        self._running()
        self._check_version(version)
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s, _ in items]
        if problems := check_plan(metas, self._expected, self._optional, self._kinds):
            raise InvalidRequest("weights do not match the model: " + "; ".join(problems))
        for m, (*_, data) in zip(metas, items, strict=True):
            if len(data) != m.nbytes:
                raise InvalidRequest(
                    f"{m.name}: {len(data)} bytes for {m.dtype}{m.shape} ({m.nbytes} expected)"
                )
        named = [(m.name, from_bytes(d, m)) for m, (*_, d) in zip(metas, items, strict=True)]
        if bad := await asyncio.to_thread(non_finite, named):  # a pass over every byte: off the loop
            raise InvalidRequest(f"{bad}: holds NaN or infinite values; weights unchanged")
        return await self._swap_in(version, Worker.LOAD_BYTES, (items,))

    async def _rpc(self, method: str, args: tuple) -> list[dict]:
        """A load-sized call into the workers. Its own length is bounded inside them (the group's
        and the ready table's timeouts); here it also ends when the EngineCore dies."""
        task = asyncio.ensure_future(self._llm.collective_rpc(method, args=args))
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if not task.done() and self._llm.errored:
                task.cancel()
                raise Unavailable("the vLLM engine died during a weight transfer")
        try:
            return task.result()
        except Exception as e:  # the workers answer outcomes: anything raised is unexpected
            raise Unavailable(f"the weight transfer failed in vLLM's workers: {e}") from e

    def _answer(self, results: list[dict], version: int, loading: bool) -> dict:
        """The replica's outcome, its state updated: raises the outcome's error, and marks the
        weights broken when a failed load had reached the model."""
        got = combine(results)
        if not got["error"]:
            return got
        if loading and got["touched"]:
            self._weights_broken = True
            status = DataLoss if got["kind"] == "data_loss" else Unavailable
            raise status(
                f"weight load of version {version} failed half-way ({got['error']}); the replica "
                "serves nothing until a complete version loads"
            )
        suffix = "; weights unchanged" if loading else ""
        raise _STATUS.get(got["kind"], Unavailable)(got["error"] + suffix)

    async def _swap_in(
        self,
        version: int,
        method: str,
        args: tuple,
        drain: tuple | None = None,
        adapter: tuple[int, int, str] | None = None,
    ) -> tuple[int, float, list[int]]:
        """Load ``version`` with ``method(*args)``. One that is not newer than what the replica
        holds once the swaps before it are done (``drain``: the arguments that take the buckets
        without loading them) is taken, then answered as done when it is the version held with
        the same bytes (a retried push that the first one reached after all), refused otherwise.
        ``adapter`` (version, vLLM's id, folder): the load wrote a LoRA adapter there, activated
        before the version changes; without it the load replaced the weights, and any adapter goes."""
        # wait: one swap at a time, each bounded (control calls ENGINE_CALL_S; the load by its
        # transport's timeouts inside the workers, or the engine's death)
        async with self._swap_lock:
            if drain is not None and version <= self.version:
                t0 = time.monotonic()
                got = self._answer(await self._rpc(method, drain), version, loading=False)
                # taken all the same, so that no sender is left blocked; then judged
                if version < self.version:
                    raise FailedPrecondition(f"version {version} is older than the replica's {self.version}")
                if self._held != (version, list(got["checksums"])):
                    raise FailedPrecondition(
                        f"version {version} is loaded already, with other bytes than this push "
                        "carries; weights unchanged"
                    )
                return got["nbytes"], time.monotonic() - t0, got["checksums"]
            self._check_version(version)
            t0 = time.monotonic()
            llm = self._llm
            async with self._gate.swap():
                # End every request in the engine (they continue once the swap is over) and clear
                # the prefix cache; the engine is idle when this returns.
                try:
                    # Inside the try: a pause that times out may still complete later, and the
                    # engine must not stay paused while health says SERVING.
                    await within(
                        llm.pause_generation(mode="abort", clear_cache=True), ENGINE_CALL_S, "pausing vLLM"
                    )
                    try:
                        results = await self._rpc(method, args)
                    except Unavailable as e:  # no outcome: how far the load got is unknown
                        self._weights_broken = True
                        raise Unavailable(
                            f"weight load of version {version} failed ({e}); the replica serves "
                            "nothing until a complete version loads"
                        ) from e
                    got = self._answer(results, version, loading=True)
                    if adapter is not None:
                        await self._activate(*adapter)
                    elif self._lora is not None:  # full weights: the whole policy, no adapter over it
                        old, self._lora = self._lora, None
                        await self._unload(old)
                    self.version = version
                    self._held = (version, list(got["checksums"]))
                    self._weights_broken = False
                    await within(llm.reset_prefix_cache(), ENGINE_CALL_S, "resetting the prefix cache")
                finally:
                    try:
                        await within(llm.resume_generation(), ENGINE_CALL_S, "resuming vLLM")
                    except Unavailable as e:  # logged, not raised over the load's own error
                        logger.error("resuming generation after a swap failed: %s", e)
                        self._weights_broken = True  # not serving what it says: not ready
            return got["nbytes"], time.monotonic() - t0, got["checksums"]
