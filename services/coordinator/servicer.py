"""CoordinatorService RPCs: experiments' lifecycle and metrics over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp
from relayrl.common import config as cfg_mod
from relayrl.common.rpc import InvalidRequest, NotFound, bounded, map_errors
from relayrl.coordinator import registry as reg
from relayrl.coordinator.assets import missing_inputs
from relayrl.coordinator.config import CoordinatorServeConfig, ExperimentConfig, resolve_paths
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

    def _inside(self, what: str, path: str) -> Path:
        """``path`` (absolute by now) if it lies in the coordinator's root, else INVALID_ARGUMENT."""
        if not Path(os.path.realpath(path)).is_relative_to(self.root):
            raise InvalidRequest(
                f"{what} {bounded(path, 200)!r} is outside the coordinator's root {self.root}"
            )
        return Path(path)

    def _experiment(self, request) -> ExperimentConfig:
        """Parse, validate and resolve the request's experiment: CPU work, run in a worker thread."""
        data = cfg_mod.parse_yaml(request.config_yaml, "config_yaml")
        cfg = resolve_paths(cfg_mod.build(ExperimentConfig, data, list(request.overrides)), base=self.root)
        self._inside("runs_dir", cfg.runs_dir)
        for what, path in (
            ("data.train", cfg.data.train),
            ("data.test", cfg.data.test),
            ("model.path", cfg.model.path),
        ):
            if path:
                self._inside(what, path)
        return cfg

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
        try:
            cfg = await asyncio.to_thread(self._experiment, request)
        except cfg_mod.ConfigError as e:
            raise InvalidRequest(str(e)) from None
        resume = None
        if request.resume_from:
            resume = self._inside("resume_from", str(self.root / request.resume_from))
            if not (resume / "checkpoints" / "coordinator.json").is_file():
                raise InvalidRequest(f"{resume} has no checkpoint to resume from")
        elif problems := missing_inputs(cfg):
            raise InvalidRequest("; ".join(problems))
        h = self.registry.start(cfg, resume, run_id=request.run_id)
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
