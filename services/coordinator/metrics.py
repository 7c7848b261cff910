"""Prometheus metrics of the coordinator: every numeric per-step value of every run."""

from prometheus_client import Gauge

RUN_METRIC = Gauge(
    "relayrl_run_metric",
    "Latest per-step value of a run's metric (reward_mean, kl, "
    "eval_accuracy, staleness_max, gen_tokens_per_s, time_generate, ...)",
    ["run_id", "name"],
)


def observe(run_id: str, record: dict) -> None:
    for k, v in record.items():
        if isinstance(v, (int, float)) and k != "time":
            RUN_METRIC.labels(run_id, k).set(float(v))
