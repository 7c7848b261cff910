"""Prometheus metrics of a gateway replica.

The metrics live at module level in the default registry (as every relayrl service keeps them),
so building a replica twice in one process registers nothing twice. ``GatewayMetrics`` is what
the replica hands around (``http.make_app``, ``core.GatewayCore``): one method per thing observed.

HTTP side (``relayrl_gateway_http_*``, ``observe_http``): requests by route and status, and their
latency. ``route`` is the matched route's path or "unmatched", so a client cannot grow the label
set by asking for made-up paths. The sessions' metrics (``relayrl_gateway_*``) sit beside these.
"""

from prometheus_client import Counter, Histogram

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


class GatewayMetrics:
    """Observations of one gateway replica, written to the module's metrics."""

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        """One answered HTTP request."""
        HTTP_REQUESTS.labels(route, str(status)).inc()
        HTTP_SECONDS.labels(route).observe(seconds)
