"""A vLLM stat logger that keeps the scheduler's running/waiting counts for GetStatus/metrics.

vLLM calls ``record`` after every engine step with its ``SchedulerStats`` (not a stable vLLM
interface, hence the defensive ``getattr``)."""

from __future__ import annotations

from relayrl.generator import metrics
from vllm.v1.metrics.loggers import StatLoggerBase


def stat_logger_factory(sink: dict[str, int]):
    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                sink["running"] = int(getattr(scheduler_stats, "num_running_reqs", 0))
                sink["waiting"] = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
                metrics.RUNNING.set(sink["running"])
                metrics.WAITING.set(sink["waiting"])

        def log_engine_initialized(self):
            pass

    return _Logger
