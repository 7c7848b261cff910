"""CoordinatorService RPCs: experiments' lifecycle and metrics over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from relayrl.common.rpc import InvalidRequest, NotFound, bounded, map_errors
from relayrl.coordinator.config import CoordinatorServeConfig
from relayrl.coordinator.service import registry as reg
from relayrl.coordinator.service.admission import admit
from relayrl.coordinator.v1 import coordinator_pb2 as cp
from relayrl.coordinator.v1 import coordinator_pb2_grpc as cpg

_STATE = {
    reg.PENDING: cp.EXPERIMENT_STATE_PENDING,
    reg.RUNNING: cp.EXPERIMENT_STATE_RUNNING,
    reg.STOPPING: cp.EXPERIMENT_STATE_STOPPING,
    reg.COMPLETED: cp.EXPERIMENT_STATE_COMPLETED,
    reg.FAILED: cp.EXPERIMENT_STATE_FAILED,
    reg.STOPPED: cp.EXPERIMENT_STATE_STOPPED,
}


def _ts(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def status_proto(h: reg.Handle) -> cp.ExperimentStatus:
    last = next((r for r in reversed(h.records) if "reward_mean" in r), {})
    return cp.ExperimentStatus(
        run_id=h.run_id,
        run_dir=str(h.run_dir),
        state=_STATE[h.state],
        step=h.step,
        total_steps=h.cfg.schedule.steps,
        policy_version=h.version,
        message=h.message,
        started_at=_ts(h.started_at) if h.started_at is not None else None,  # unset while PENDING
        last_metrics={k: float(v) for k, v in last.items() if isinstance(v, (int, float)) and k != "time"},
    )


def record_proto(run_id: str, rec: dict) -> cp.MetricsRecord:
    return cp.MetricsRecord(
        run_id=run_id,
        step=int(rec.get("step", 0)),
        time=_ts(rec.get("time", 0.0)),
        values={
            k: float(v) for k, v in rec.items() if isinstance(v, (int, float)) and k not in ("step", "time")
        },
    )


MAX_OVERRIDES = 256
MAX_OVERRIDE_CHARS = 4096
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class CoordinatorServicer(cpg.CoordinatorServiceServicer):
    def __init__(self, registry: reg.Registry, config: CoordinatorServeConfig | None = None):
        self.registry = registry
        self.config = config or CoordinatorServeConfig()
        self.root = Path(os.path.realpath(self.config.root))

    def _handle(self, run_id: str) -> reg.Handle:
        h = self.registry.get(run_id)
        if h is None:
            raise NotFound(f"no experiment {bounded(repr(run_id), 140)} on this coordinator")
        return h

    @map_errors
    async def StartExperiment(self, request, context):
        # Everything is checked before the answer: an OK means the experiment is under way.
        if len(request.config_yaml) > self.config.max_config_kib * 1024:
            raise InvalidRequest(
                f"config_yaml is larger than {self.config.max_config_kib} KiB (max_config_kib)"
            )
        if len(request.overrides) > MAX_OVERRIDES or any(
            len(o) > MAX_OVERRIDE_CHARS for o in request.overrides
        ):
            raise InvalidRequest(
                f"overrides: at most {MAX_OVERRIDES}, each at most {MAX_OVERRIDE_CHARS} characters"
            )
        if request.run_id:
            if not _RUN_ID.fullmatch(request.run_id):
                raise InvalidRequest(
                    "run_id: 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
                )
            if (known := self.registry.get(request.run_id)) is not None:
                return cp.StartExperimentResponse(experiment=status_proto(known))  # idempotent by run_id
        cfg, resume = await asyncio.to_thread(
            admit, request.config_yaml, list(request.overrides), request.resume_from, self.root
        )
        h = self.registry.start(cfg, resume, run_id=request.run_id)  # a run_id started meanwhile: that one
        return cp.StartExperimentResponse(experiment=status_proto(h))

    @map_errors
    async def GetExperimentStatus(self, request, context):
        return cp.GetExperimentStatusResponse(experiment=status_proto(self._handle(request.run_id)))

    @map_errors
    async def StopExperiment(self, request, context):
        self._handle(request.run_id)
        h = self.registry.request_stop(request.run_id)
        return cp.StopExperimentResponse(experiment=status_proto(h))

    @map_errors
    async def ListExperiments(self, request, context):
        return cp.ListExperimentsResponse(experiments=[status_proto(h) for h in self.registry.newest_first()])

    @map_errors
    async def StreamMetrics(self, request, context):
        h = self._handle(request.run_id)
        sent = 0
        while True:
            for rec in h.records[sent:]:
                sent += 1
                if rec.get("step", 0) >= request.from_step:
                    yield cp.StreamMetricsResponse(record=record_proto(h.run_id, rec))
            if h.finished and sent >= len(h.records):
                return
            # wait: the lock is only ever held without an await in between (wait() releases it)
            async with h.changed:
                if sent >= len(h.records) and not h.finished:
                    # wait: a stream lasts as long as its run: every record and the run's end
                    # notify; the caller's deadline or cancellation ends it sooner
                    await h.changed.wait()
