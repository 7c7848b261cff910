"""Prometheus metrics of the learner (rank 0)."""

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("relayrl_learner_steps", "Optimizer steps taken")
TOKENS = Counter("relayrl_learner_tokens", "Completion tokens trained on (rate = tokens/s)")
LOSS = Gauge("relayrl_learner_loss", "Loss of the last step")
GRAD_NORM = Gauge("relayrl_learner_grad_norm", "Gradient norm of the last step")
STEP_SECONDS = Histogram(
    "relayrl_learner_step_seconds",
    "Time of one TrainStep",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
SYNC_SECONDS = Histogram(
    "relayrl_learner_sync_seconds",
    "Time of one PushWeights",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)


def observe_step(m: dict) -> None:
    STEPS.inc()
    TOKENS.inc(m["tokens"])
    LOSS.set(m["loss"])
    GRAD_NORM.set(m["grad_norm"])
    STEP_SECONDS.observe(m["step_seconds"])
