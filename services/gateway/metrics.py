"""Prometheus metrics of a gateway replica.

The metrics live at module level in the default registry (as every relayrl service keeps them),
so building a replica twice in one process registers nothing twice. ``GatewayMetrics`` is what
the replica hands around (``http.make_app``, ``core.GatewayCore``): one method per thing observed.

HTTP side (``relayrl_gateway_http_*``, ``observe_http``): requests by route and status, and their
latency. ``route`` is the matched route's path or "unmatched", so a client cannot grow the label
set by asking for made-up paths. Connections and requests refused below the routes (``refused``,
by reason), which are logged once per peer at most. The sessions' metrics (``relayrl_gateway_*``)
sit beside these.
"""

from prometheus_client import Counter, Gauge, Histogram

HTTP_REQUESTS = Counter(
    "relayrl_gateway_http_requests",
    "HTTP requests answered, by route and status (499: the client left before the answer was sent)",
    ["route", "status"],
)
HTTP_SECONDS = Histogram(
    "relayrl_gateway_http_seconds",
    "Time from a request's arrival to the end of its answer (the model's turn included), by route",
    ["route"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
HTTP_REFUSED = Counter(
    "relayrl_gateway_http_refused",
    "Connections or requests refused below the routes, by reason (peer_connections, evicted, "
    "header_timeout, full, out_of_fds, accept_error, malformed)",
    ["reason"],
)


SESSIONS_OPEN = Gauge("relayrl_gateway_sessions_open", "Sessions open now")
CALLS = Counter("relayrl_gateway_calls", "Chat requests sampled on a generator")
CALL_SECONDS = Histogram(
    "relayrl_gateway_call_seconds",
    "Time of one chat request's Generate call",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
COMPLETION_TOKENS = Counter(
    "relayrl_gateway_completion_tokens", "Tokens the model generated through the gateway"
)
CALL_FAILURES = Counter(
    "relayrl_gateway_call_failures", "Chat requests that got no answer, by error", ["error"]
)
SESSIONS_CLOSED = Counter("relayrl_gateway_sessions_closed", "Sessions closed by the coordinator")
HISTORY_BREAKS = Counter(
    "relayrl_gateway_history_breaks",
    "Requests that did not extend an earlier answer (a new segment), by reason",
    ["reason"],
)

MALFORMED_CALLS = Counter(
    "relayrl_gateway_malformed_calls",
    "Tool calls the model wrote that did not parse, in closed sessions",
)
CONSTRAINED_CALLS = Counter(
    "relayrl_gateway_constrained_calls",
    "Chat requests sampled under an enforced tool choice (required or a named function), in closed sessions",
)


class CoreMetrics:
    """The sessions' side (``core.GatewayCore``)."""

    def sessions(self, n: int) -> None:
        SESSIONS_OPEN.set(n)

    def call(self, seconds: float, tokens: int) -> None:
        CALLS.inc()
        CALL_SECONDS.observe(seconds)
        COMPLETION_TOKENS.inc(tokens)

    def failed(self, error: str) -> None:
        CALL_FAILURES.labels(error).inc()

    def closed(self, out) -> None:
        """A closed session (``gateway_pb2.CloseSessionResponse``): its history breaks, malformed
        and constrained calls."""
        SESSIONS_CLOSED.inc()
        for reason, n in out.break_reasons.items():
            HISTORY_BREAKS.labels(reason).inc(n)
        MALFORMED_CALLS.inc(out.malformed_calls)
        CONSTRAINED_CALLS.inc(out.constrained_calls)


class GatewayMetrics(CoreMetrics):
    """Observations of one gateway replica, written to the module's metrics."""

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        """One answered HTTP request."""
        HTTP_REQUESTS.labels(route, str(status)).inc()
        HTTP_SECONDS.labels(route).observe(seconds)

    def refused(self, reason: str) -> None:
        """A connection or request refused below the routes (``connections.py``)."""
        HTTP_REFUSED.labels(reason).inc()
