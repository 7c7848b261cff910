"""CoordinatorService RPCs: experiments' lifecycle and metrics over gRPC."""

from __future__ import annotations

import yaml
from google.protobuf.timestamp_pb2 import Timestamp
from relayrl.common import config as cfg_mod
from relayrl.common.rpc import InvalidRequest, NotFound, check_no_unknown_fields, map_errors
from relayrl.coordinator import registry as reg
from relayrl.coordinator.config import ExperimentConfig, resolve_paths
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
        started_at=_ts(h.started_at),
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


class CoordinatorServicer(cpg.CoordinatorServiceServicer):
    def __init__(self, registry: reg.Registry):
        self.registry = registry

    def _handle(self, run_id: str) -> reg.Handle:
        h = self.registry.get(run_id)
        if h is None:
            raise NotFound(f"no experiment {run_id!r} on this coordinator")
        return h

    @map_errors
    async def StartExperiment(self, request, context):
        check_no_unknown_fields(request)
        try:
            data = yaml.safe_load(request.config_yaml) or {}
        except yaml.YAMLError as e:
            raise InvalidRequest(f"config_yaml is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise InvalidRequest("config_yaml must be a mapping of sections")
        try:
            cfg = resolve_paths(cfg_mod.build(ExperimentConfig, data, list(request.overrides)), base=None)
        except cfg_mod.ConfigError as e:
            raise InvalidRequest(str(e)) from None
        resume = None
        if request.resume_from:
            from pathlib import Path

            resume = Path(request.resume_from)
            if not (resume / "checkpoints" / "coordinator.json").exists():
                raise InvalidRequest(f"{resume} has no checkpoint to resume from")
        try:
            h = self.registry.start(cfg, resume)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
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
        return cp.ListExperimentsResponse(
            experiments=[status_proto(h) for h in self.registry.experiments.values()]
        )

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
            async with h.changed:
                if sent >= len(h.records) and not h.finished:
                    await h.changed.wait()
