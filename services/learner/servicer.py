"""LearnerService RPCs on rank 0: translate, serialise collective work, map errors.

Collective operations (train, push, save, load, export) run one at a time, in a worker thread,
so the event loop keeps answering GetStatus and health checks during a long step. Once started,
an operation runs to its end even if its caller goes away (a deadline passes, a connection
drops): the other ranks are already in it. The lock is held until it ends, so a retry never
overlaps it, and a TrainStep's response is kept by step, so the retry gets the response of the
step it names. A TrainStep whose deadline passed before it could start is not taken.

Paths a caller sends name folders inside ``checkpoint_dir``: relative ones resolve under it,
absolute ones must lie in it; anything else is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from relayrl.common import logcontext
from relayrl.common.rpc import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidRequest,
    ServiceError,
    Unavailable,
    bounded,
    map_errors,
    to_the_end,
)
from relayrl.learner import metrics
from relayrl.learner.core import LearnerCore, check_client_state, check_tag
from relayrl.learner.sync import WeightSync
from relayrl.learner.v1 import learner_pb2, learner_pb2_grpc

logger = logging.getLogger(__name__)

_METRIC_FIELDS = ("loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "step_seconds")
KEPT_RESPONSES = 8
"""TrainStep responses kept for retries (the last steps taken)."""
MAX_PATH_CHARS = 1024


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
        self.checkpoint_dir = Path(os.path.realpath(checkpoint_dir))
        self.sync = sync
        self.bucket_bytes = bucket_bytes
        self.max_tokens = max_tokens
        self.lock = asyncio.Lock()
        # step -> (request fingerprint, response) of the last steps taken
        self.responses: OrderedDict[int, tuple[bytes, learner_pb2.TrainStepResponse]] = OrderedDict()
        self.broken: str | None = None
        self.on_broken = on_broken

    @property
    def trainer(self):
        return self.core.trainer

    def resolve(self, path: str) -> str:
        """A request's path on this learner's filesystem, inside ``checkpoint_dir``: empty -> the
        folder itself, relative -> under it (no ``..``), absolute -> only if it lies in it (after
        following symbolic links)."""
        if not path:
            return str(self.checkpoint_dir)
        if len(path) > MAX_PATH_CHARS or "\0" in path:
            raise InvalidRequest(f"path: at most {MAX_PATH_CHARS} characters, no NUL")
        p = PurePosixPath(path)
        if ".." in p.parts:
            raise InvalidRequest(f"path {bounded(path, 200)!r}: '..' is not allowed")
        full = Path(path) if p.is_absolute() else self.checkpoint_dir / p
        real = Path(os.path.realpath(full))
        if not real.is_relative_to(self.checkpoint_dir):
            raise InvalidRequest(
                f"path {bounded(path, 200)!r} is outside the learner's checkpoint_dir {self.checkpoint_dir}"
            )
        return str(full)

    async def _exclusive(self, fn, *args, deadline: float | None = None):
        """Run one collective op alone, to its end whatever happens to the caller (see module
        doc); refused unstarted when ``deadline`` (monotonic) passed while it waited its turn."""

        async def run():
            # wait: held only around one collective op, which the ranks' heartbeat bounds
            # (heartbeat_timeout_seconds); a caller whose deadline passed meanwhile is refused
            async with self.lock:
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded(
                        "the deadline passed before the operation could start; nothing was done"
                    )
                return await self._collective(fn, *args)

        return await to_the_end(run())

    async def _collective(self, fn, *args):
        """Run one collective op; an unexpected failure leaves ranks out of step: stop serving."""
        if self.broken:
            raise Unavailable(f"learner stopped after an earlier failure: {self.broken}")
        try:
            return await asyncio.to_thread(fn, *args)
        except ServiceError:  # refused before any collective, or ranks still in step
            raise
        except Exception as e:
            self.broken = bounded(f"{type(e).__name__}: {e}", 300)
            if self.on_broken:
                self.on_broken()
            raise

    def _train(self, request: learner_pb2.TrainStepRequest, fingerprint: bytes):
        """Rank 0's step (worker thread, lock held): a step already taken answers from memory."""
        done = self.trainer.step
        if request.step <= done:
            kept = self.responses.get(request.step)
            if kept is None:
                raise FailedPrecondition(f"step {request.step} is not the next step ({done + 1})")
            if kept[0] != fingerprint:
                raise FailedPrecondition(f"step {request.step} was already taken with a different batch")
            return kept[1]  # a retry: the same answer, no second step
        if request.step != done + 1:
            raise FailedPrecondition(f"step {request.step} is not the next step ({done + 1})")
        m = self.core.train(request, self.max_tokens)
        metrics.observe_step(m)
        resp = learner_pb2.TrainStepResponse(
            step=self.trainer.step,
            policy_version=self.trainer.version,
            metrics=learner_pb2.TrainMetrics(
                **{k: m[k] for k in _METRIC_FIELDS},
                tokens=m["tokens"],
                samples=m["samples"],
                extra={
                    k: float(v)
                    for k, v in m.items()
                    if k not in (*_METRIC_FIELDS, "tokens", "samples") and isinstance(v, int | float)
                },
            ),
        )
        self.responses[request.step] = (fingerprint, resp)
        while len(self.responses) > KEPT_RESPONSES:
            self.responses.popitem(last=False)
        return resp

    @map_errors
    async def TrainStep(self, request, context):
        fingerprint = hashlib.sha256(request.SerializeToString(deterministic=True)).digest()
        return await self._exclusive(self._train, request, fingerprint, deadline=_deadline(context))

    @map_errors
    async def RegisterGenerator(self, request, context):
        if not request.address or not request.replica_id:
            raise InvalidRequest("address and replica_id are required")
        if len(request.address) > 512 or len(request.replica_id) > 256:
            raise InvalidRequest("address takes at most 512 characters, replica_id 256")
        self.core.require("actor", what="RegisterGenerator")
        # The weight sync's own lock, not the collective one: TrainStep never waits for a replica
        # being registered. Not shielded: a caller that gives up (cancels, or its deadline
        # passes) takes its registration with it, undone, never done after it left.
        transport = await self.sync.register(request.replica_id, request.address, deadline=_deadline(context))
        return learner_pb2.RegisterGeneratorResponse(
            replica_ids=self.sync.replica_ids(), policy_version=self.trainer.version, transport=transport
        )

    @map_errors
    async def UnregisterGenerator(self, request, context):
        await self.sync.unregister(request.replica_id, deadline=_deadline(context))
        return learner_pb2.UnregisterGeneratorResponse(replica_ids=self.sync.replica_ids())

    @map_errors
    async def PushWeights(self, request, context):
        only = request.transport_only
        bucket_bytes = request.bucket_bytes or self.bucket_bytes

        self.core.require("actor", what="PushWeights")

        @contextlib.asynccontextmanager
        async def ranks():
            # Held for the gather + send only: the replicas' answers are awaited after it, so a
            # slow or silent replica does not hold TrainStep (sync.py bounds that wait).
            # wait: held only around one collective op, as in _exclusive
            async with self.lock:
                if not only and request.version != self.trainer.version:
                    raise FailedPrecondition(
                        f"version {request.version} is not the learner's policy version {self.trainer.version}"
                    )
                yield

        async def push():
            t0 = time.monotonic()
            sent, replicas = await self.sync.push(
                request.version,
                bucket_bytes,
                lambda plan, sinks: self._collective(self.core.push, plan, sinks, only),
                transport_only=only,
                exclusive=ranks,
            )
            return sent, replicas, time.monotonic() - t0

        sent, replicas, secs = await to_the_end(push())
        if not only:
            metrics.SYNC_SECONDS.observe(secs)
        return learner_pb2.PushWeightsResponse(
            version=request.version, seconds=secs, bytes=sent, replica_ids=replicas
        )

    @map_errors
    async def SaveCheckpoint(self, request, context):
        path = self.resolve(request.path)
        tag = check_tag(request.tag) if request.tag else ""
        check_client_state(request.client_state_json)
        t0 = time.monotonic()

        def save():
            name = tag or f"step{self.trainer.step}"
            self.core.save(path, name, request.client_state_json)
            return name, self.trainer.step, self.trainer.version

        name, step, version = await self._exclusive(save)
        return learner_pb2.SaveCheckpointResponse(
            path=path, tag=name, step=step, policy_version=version, seconds=time.monotonic() - t0
        )

    @map_errors
    async def LoadCheckpoint(self, request, context):
        path = self.resolve(request.path)
        tag = check_tag(request.tag) if request.tag else ""

        def load():
            meta = self.core.load(path, tag)
            self.responses.clear()  # steps of another history
            return meta

        meta = await self._exclusive(load)
        return learner_pb2.LoadCheckpointResponse(
            step=meta["step"],
            policy_version=meta["policy_version"],
            client_state_json=meta["client_state_json"],
            tag=meta["tag"],
        )

    @map_errors
    async def ExportModel(self, request, context):
        if not request.path:
            raise InvalidRequest("path is required: the folder to export to")
        path = self.resolve(request.path)
        if Path(path) == self.checkpoint_dir:
            raise InvalidRequest("path must name a folder inside checkpoint_dir, not checkpoint_dir itself")
        t0 = time.monotonic()

        def export():
            self.core.export(path, self.bucket_bytes, request.adapter)
            return self.trainer.version

        version = await self._exclusive(export)
        return learner_pb2.ExportModelResponse(
            path=path, policy_version=version, seconds=time.monotonic() - t0
        )

    async def _score(self, request, what: str, context):
        deadline = _deadline(context)
        t0 = time.monotonic()
        with logcontext.bound(run_id=request.run_id or None):
            out = await self._exclusive(self.core.score, request.sequences, what, deadline=deadline)
        return [learner_pb2.TokenValues(values=v) for v in out], time.monotonic() - t0

    @map_errors
    async def ComputeLogprobs(self, request, context):
        out, secs = await self._score(request, "logprobs", context)
        return learner_pb2.ComputeLogprobsResponse(
            logprobs=out, policy_version=self.trainer.version, seconds=secs
        )

    @map_errors
    async def ComputeValues(self, request, context):
        out, secs = await self._score(request, "values", context)
        return learner_pb2.ComputeValuesResponse(values=out, step=self.trainer.step, seconds=secs)

    @map_errors
    async def GetStatus(self, request, context):
        return learner_pb2.GetStatusResponse(
            model=self.trainer.cfg.model,
            world_size=self.trainer.world_size,
            step=self.trainer.step,
            policy_version=self.trainer.version,
            ready=self.broken is None,
            role=self.core.role,
            generators=[
                learner_pb2.RegisteredGenerator(replica_id=r, address=a, policy_version=v, transport=t)
                for r, a, v, t in self.sync.members()
            ],
        )


def _deadline(context) -> float | None:
    """The caller's deadline on the monotonic clock (None: it set none)."""
    left = context.time_remaining()
    return time.monotonic() + left if left is not None else None
