"""Configuration of the gateway: its gRPC control API (``serve``), its OpenAI-compatible HTTP
API (``http``), the generators it forwards to, and the bounds on sessions and requests."""

from __future__ import annotations

from pydantic import Field, model_validator
from relayrl.common.config import StrictModel
from relayrl.common.serving import ClientSecurity, ServeConfig


class HttpConfig(StrictModel):
    """Where agents reach the OpenAI-compatible API."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback needs ``tls_cert``/``tls_key`` (the session keys
    travel in every request), or an explicit ``insecure``."""
    port: int = Field(0, ge=0, le=65535)
    """HTTP port; 0 picks a free one (logged, and in OpenSessionResponse.base_url)."""
    public_url: str = Field("", max_length=512)
    """Base URL handed to agents (OpenSessionResponse.base_url), e.g. the Kubernetes service's
    "http://relayrl-gateway:8000/v1"; empty: ``http(s)://<public_host or host>:<port>/v1`` as
    bound."""
    public_host: str = Field("", max_length=255, pattern=r"^[A-Za-z0-9.:_-]*$")
    """Host named in that bound base URL when ``public_url`` is empty, with the port as bound
    (``port`` 0 included): the node's address when ``host`` is a wildcard ("0.0.0.0", "::"), as
    the Ray launcher sets it; empty: ``host``."""
    tls_cert: str | None = Field(None, min_length=1)
    """PEM certificate chain; with ``tls_key`` the API is served over HTTPS only."""
    tls_key: str | None = Field(None, min_length=1)
    """PEM private key of ``tls_cert``."""
    insecure: bool = False
    """Allow a non-loopback ``host`` without TLS (a mesh that adds TLS in front)."""
    max_body_mb: float = Field(4.0, gt=0, le=256)
    """Largest request body, in MiB; a larger one gets 413. An agent's whole history travels in
    each request: room for long dialogues, not for anything a person would call an upload."""
    request_timeout_seconds: float = Field(600.0, gt=0, le=86400)
    """Longest a chat request may take, queueing for a generator included; past it, 504."""
    body_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    """Longest a request body may take to arrive; past it, 408 (a client that trickles its body
    holds no handler)."""
    header_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    """Longest a connection may wait for a whole request head (request line and headers),
    counted from its opening and from the end of its previous answer; past it the connection is
    closed. This is the keep-alive time of an idle connection too (HTTP clients drop theirs
    sooner: httpx, under the openai SDK, after 5 s)."""
    max_connections: int = Field(1024, ge=1, le=1_000_000)
    """Most connections open at once. At the bound, a new one closes the connection that has
    waited longest for a request head; when every connection is busy with a request, new ones
    wait in the listen backlog. At most half the process's file-descriptor limit
    (``RLIMIT_NOFILE``) whatever this says, so the gRPC API and the generators keep theirs."""
    max_connections_per_peer: int = Field(256, ge=1, le=1_000_000)
    """Most connections open at once from one address; more are closed as soon as accepted.
    Agents behind one forwarder (the env service's sandboxes) share its address: leave room for
    all of them."""
    max_unfinished_per_key: int = Field(4, ge=1, le=100_000)
    """Most requests of one session key whose bodies are still arriving or being decoded; more
    get 429 before their body is read (with ``Expect: 100-continue``, before it is sent). One key
    holds at most this many times ``max_body_mb`` in bodies."""
    max_unfinished_per_peer: int = Field(64, ge=1, le=100_000)
    """Most requests from one address whose bodies are still arriving or being decoded, whatever
    their keys; more get 429 the same way."""

    @model_validator(mode="after")
    def _tls(self) -> HttpConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("http.tls_cert and http.tls_key go together: give both or neither")
        loopback = self.host in ("localhost", "::1") or self.host.startswith("127.")
        if not loopback and not self.tls_cert and not self.insecure:
            raise ValueError(
                f"http.host {self.host!r} is not loopback: give http.tls_cert and http.tls_key, or set "
                "http.insecure (a trusted network, or TLS in front)"
            )
        return self


class GatewayConfig(StrictModel):
    """One gateway replica."""

    serve: ServeConfig = Field(default_factory=ServeConfig)
    """Where the gRPC control API (relayrl.gateway.v1) listens, and who may call it."""
    http: HttpConfig = Field(default_factory=HttpConfig)
    """Where the OpenAI-compatible API listens."""
    generators: list[str] = Field(default_factory=list, max_length=4096)
    """Generator replicas (host:port) the gateway samples on. A session's calls go to one
    replica while it serves (rendezvous on the episode id: its prefix cache), the next otherwise."""
    client: ClientSecurity = Field(default_factory=ClientSecurity)
    """How the gateway calls the generators (TLS, token)."""
    model_name: str = Field("relayrl-policy", min_length=1, max_length=256)
    """The model name agents ask for (GET /v1/models); another name gets 404."""
    max_sessions: int = Field(4096, ge=1, le=1_000_000)
    """Most sessions open at once; an OpenSession past it is RESOURCE_EXHAUSTED."""
    max_in_flight: int = Field(256, ge=1, le=100_000)
    """Most chat requests being sampled at once; more get 429 with Retry-After (the generators'
    own admission, ``max_pending_requests``, answers the same way)."""
    max_in_flight_per_session: int = Field(16, ge=1, le=100_000)
    """Most chat requests of one session being sampled at once (an agent's parallel calls);
    more get 429, so one agent cannot take every slot of ``max_in_flight``."""
    retry_after_seconds: float = Field(1.0, gt=0, le=3600)
    """What a 429 tells the agent to wait."""
    session_ttl_seconds: float = Field(1800.0, gt=0, le=86400)
    """A session no request touches for this long is dropped (its key stops working); the
    backstop for sessions a coordinator that died left open."""
    closed_keep_seconds: float = Field(600.0, ge=0, le=86400)
    """How long a closed session's answer is kept: a retried CloseSession gets it again."""
    max_calls_per_session: int = Field(256, ge=1, le=100_000)
    """Most chat requests in one session (OpenSessionRequest.max_calls may lower it)."""
    generate_deadline_seconds: float = Field(300.0, gt=0, le=86400)
    """Deadline of one Generate call to a generator."""
    replica_id: str = Field("", max_length=256)
    """Id in logs; empty: ``<hostname>:<pid>``."""
