"""Prometheus metrics of a generator replica (vLLM's own ``vllm:*`` metrics are served too)."""

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("relayrl_generator_tokens", "Completion tokens generated (rate = tokens/s)")
SAMPLES = Counter("relayrl_generator_samples", "Completions finished", ["finish_reason"])
REQUESTS = Counter("relayrl_generator_requests", "Generate calls by final status", ["code"])
RUNNING = Gauge("relayrl_generator_requests_running", "Sequences being decoded")
WAITING = Gauge("relayrl_generator_requests_waiting", "Sequences queued, not yet scheduled")
VERSION = Gauge("relayrl_generator_policy_version", "Policy version of the loaded weights")
SWAP_SECONDS = Histogram(
    "relayrl_generator_swap_seconds",
    "Weight swap time, request to new weights serving",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
SPECIAL_TEXT = Counter(
    "relayrl_generator_special_token_text",
    "Chat messages whose content held a special token's text (a forged turn, tokenized as text), "
    "by role ('tools': the tool schemas; 'other': any unknown role)",
    ["role"],
)
