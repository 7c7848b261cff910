"""Prometheus metrics of a reward replica.

``data_source`` labels carry only the sources this replica scores (anything else is counted as
``unknown``), so a client cannot grow the label set without bound.
"""

from prometheus_client import Counter, Gauge, Histogram

SAMPLES = Counter(
    "relayrl_reward_samples",
    "Samples scored, by data source and status ok/error/timeout (rate = samples/s)",
    ["data_source", "status"],
)
SAMPLE_SECONDS = Histogram(
    "relayrl_reward_sample_seconds",
    "Time one sample spent in a scoring worker",
    ["data_source"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REQUESTS = Counter("relayrl_reward_requests", "Score calls by final status", ["code"])
REQUEST_SECONDS = Histogram(
    "relayrl_reward_request_seconds",
    "Score call time, request to response",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
WORKERS = Gauge("relayrl_reward_workers", "Scoring worker processes")
BUSY = Gauge("relayrl_reward_workers_busy", "Scoring workers holding a sample")
QUEUED = Gauge("relayrl_reward_samples_queued", "Samples waiting for a free worker")
PENDING = Gauge(
    "relayrl_reward_samples_pending",
    "Samples of Score calls in progress, queued or scoring (capped by max_pending_items)",
)
WORKER_RESTARTS = Counter(
    "relayrl_reward_worker_restarts",
    "Scoring workers replaced, by reason (timeout: killed past the per-sample limit; died)",
    ["reason"],
)
