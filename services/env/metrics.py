"""Prometheus metrics of an environment replica.

``env`` labels carry only the envs this replica runs (a request naming another is refused before
anything is counted), so a client cannot grow the label set without bound.
"""

from prometheus_client import Counter, Gauge, Histogram

SESSIONS_OPEN = Gauge("relayrl_env_sessions_open", "Sessions open now (capped by max_sessions)")
HUNG_THREADS = Gauge(
    "relayrl_env_hung_threads", "Env threads held by env code that ran past its limit (all: NOT_SERVING)"
)
RESETS = Counter("relayrl_env_resets", "Sessions opened, by env (a retried Reset is not counted)", ["env"])
STEPS = Counter("relayrl_env_steps", "Steps run, by env (a replayed step is not counted)", ["env"])
STEP_REPLAYS = Counter("relayrl_env_step_replays", "Retried steps answered from the stored response", ["env"])
STEP_SECONDS = Histogram(
    "relayrl_env_step_seconds",
    "Time the env took to answer one step (tool calls included)",
    ["env"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TOOL_CALLS = Counter(
    "relayrl_env_tool_calls",
    "Tool calls answered, by env and status (ok, invalid_args, unknown_tool, timeout, crashed, "
    "output_truncated, parse_error)",
    ["env", "status"],
)
CLOSES = Counter(
    "relayrl_env_closes", "Sessions closed, by env and outcome (ok, mask, redo)", ["env", "outcome"]
)
EXPIRED = Counter(
    "relayrl_env_sessions_expired", "Sessions closed by the replica: idle past their lease", ["env"]
)
ENV_FAILURES = Counter(
    "relayrl_env_failures",
    "Failures of env code itself, by env and kind (env_crashed, env_timeout), where they happened "
    "(reset, step, reward)",
    ["env", "kind", "where"],
)
REQUESTS = Counter("relayrl_env_requests", "Calls by RPC and final status", ["rpc", "code"])
