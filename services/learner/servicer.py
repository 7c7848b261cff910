"""LearnerService RPCs on rank 0: translate, serialise collective work, map errors.

Collective operations (train, push, save, load, export) run one at a time, in a worker thread,
so the event loop keeps answering GetStatus and health checks during a long step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from relayrl.common.rpc import (
    FailedPrecondition,
    InvalidRequest,
    ServiceError,
    Unavailable,
    check_no_unknown_fields,
    map_errors,
)
from relayrl.learner import metrics
from relayrl.learner.core import LearnerCore
from relayrl.learner.sync import WeightSync
from relayrl.learner.v1 import learner_pb2, learner_pb2_grpc

logger = logging.getLogger(__name__)

_METRIC_FIELDS = ("loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "step_seconds")


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(
        self,
        core: LearnerCore,
        sync: WeightSync,
        bucket_bytes: int,
        max_tokens: int,
        on_broken: Callable[[], None] | None = None,
        *,
        checkpoint_dir: str | Path,
    ):
        self.core = core
        self.checkpoint_dir = Path(checkpoint_dir).resolve()
        self.sync = sync
        self.bucket_bytes = bucket_bytes
        self.max_tokens = max_tokens
        self.lock = asyncio.Lock()
        self.last: learner_pb2.TrainStepResponse | None = None
        self.broken: str | None = None
        self.on_broken = on_broken

    @property
    def trainer(self):
        return self.core.trainer

    def resolve(self, path: str) -> str:
        """A request's path on this learner's filesystem: empty -> ``checkpoint_dir``, relative
        -> under it (no ``..``: a caller names folders inside it, never outside), absolute as is."""
        if not path:
            return str(self.checkpoint_dir)
        p = PurePosixPath(path)
        if p.is_absolute():
            return path
        if ".." in p.parts:
            raise InvalidRequest(f"path {path!r}: '..' is not allowed in a relative path")
        return str(self.checkpoint_dir / p)

    async def _collective(self, fn, *args):
        """Run one collective op; an unexpected failure leaves ranks out of step: stop serving."""
        if self.broken:
            raise Unavailable(f"learner stopped after an earlier failure: {self.broken}")
        try:
            return await asyncio.to_thread(fn, *args)
        except (ServiceError, FileNotFoundError):  # refused before any collective, or ranks still in step
            raise
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            if self.on_broken:
                self.on_broken()
            raise

    @map_errors
    async def TrainStep(self, request, context):
        check_no_unknown_fields(request)
        async with self.lock:
            done = self.trainer.step
            if self.last is not None and request.step == done:
                return self.last  # a retry of the step just taken: same answer, no second step
            if request.step != done + 1:
                raise FailedPrecondition(f"step {request.step} is not the next step ({done + 1})")
            m = await self._collective(self.core.train, request, self.max_tokens)
            metrics.observe_step(m)
            resp = learner_pb2.TrainStepResponse(
                step=self.trainer.step,
                policy_version=self.trainer.version,
                metrics=learner_pb2.TrainMetrics(
                    **{k: m[k] for k in _METRIC_FIELDS},
                    tokens=m["tokens"],
                    samples=m["samples"],
                    extra={
                        k: float(v) for k, v in m.items() if k not in (*_METRIC_FIELDS, "tokens", "samples")
                    },
                ),
            )
            self.last = resp
            return resp

    @map_errors
    async def RegisterGenerator(self, request, context):
        check_no_unknown_fields(request)
        if not request.address or not request.replica_id:
            raise InvalidRequest("address and replica_id are required")
        self.sync.register(request.replica_id, request.address)
        return learner_pb2.RegisterGeneratorResponse(
            replica_ids=self.sync.replica_ids(), policy_version=self.trainer.version
        )

    @map_errors
    async def UnregisterGenerator(self, request, context):
        await self.sync.unregister(request.replica_id)
        return learner_pb2.UnregisterGeneratorResponse(replica_ids=self.sync.replica_ids())

    @map_errors
    async def PushWeights(self, request, context):
        check_no_unknown_fields(request)
        async with self.lock:
            only = request.transport_only
            if not only and request.version != self.trainer.version:
                raise FailedPrecondition(
                    f"version {request.version} is not the learner's policy version {self.trainer.version}"
                )
            t0 = time.monotonic()
            bucket_bytes = request.bucket_bytes or self.bucket_bytes
            sent, replicas = await self.sync.push(
                request.version,
                bucket_bytes,
                lambda group: self._collective(self.core.push, bucket_bytes, self.sync.dtype, group, only),
                transport_only=only,
            )
            secs = time.monotonic() - t0
            if not only:
                metrics.SYNC_SECONDS.observe(secs)
            return learner_pb2.PushWeightsResponse(
                version=request.version, seconds=secs, bytes=sent, replica_ids=replicas
            )

    @map_errors
    async def SaveCheckpoint(self, request, context):
        check_no_unknown_fields(request)
        path = self.resolve(request.path)
        async with self.lock:
            t0 = time.monotonic()
            tag = request.tag or f"step{self.trainer.step}"
            await self._collective(self.core.save, path, tag, request.client_state_json)
            return learner_pb2.SaveCheckpointResponse(
                path=path,
                tag=tag,
                step=self.trainer.step,
                policy_version=self.trainer.version,
                seconds=time.monotonic() - t0,
            )

    @map_errors
    async def LoadCheckpoint(self, request, context):
        check_no_unknown_fields(request)
        path = self.resolve(request.path)
        async with self.lock:
            try:
                meta = await self._collective(self.core.load, path, request.tag)
            except FileNotFoundError as e:
                raise FailedPrecondition(str(e)) from None
            self.last = None
            return learner_pb2.LoadCheckpointResponse(
                step=meta["step"],
                policy_version=meta["policy_version"],
                client_state_json=meta["client_state_json"],
                tag=request.tag,
            )

    @map_errors
    async def ExportModel(self, request, context):
        check_no_unknown_fields(request)
        if not request.path:
            raise InvalidRequest("path is required: the folder to export to")
        path = self.resolve(request.path)
        async with self.lock:
            t0 = time.monotonic()
            await self._collective(self.core.export, path, self.bucket_bytes)
            return learner_pb2.ExportModelResponse(
                path=path, policy_version=self.trainer.version, seconds=time.monotonic() - t0
            )

    @map_errors
    async def GetStatus(self, request, context):
        return learner_pb2.GetStatusResponse(
            model=self.trainer.cfg.model,
            world_size=self.trainer.world_size,
            step=self.trainer.step,
            policy_version=self.trainer.version,
            ready=self.broken is None,
            generators=[
                learner_pb2.RegisteredGenerator(replica_id=r, address=a, policy_version=v)
                for r, a, v in self.sync.members()
            ],
        )
