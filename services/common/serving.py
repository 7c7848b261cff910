"""Settings every gRPC service shares: where it listens, who may call it, how it is watched, how it
stops; and ``ClientSecurity``, how a process that calls services proves who it is.

Only paths travel in these models: certificates, keys and the bearer token stay in files (mounted
secrets), so a resolved config in a run folder or a command line in ``ps`` holds no secret.
``relayrl.common.security`` turns them into credentials.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from relayrl.common.config import StrictModel

TOKEN_FILE_ENV = "RELAYRL_TOKEN_FILE"
"""Environment variable naming the bearer token file when a config gives none (servers and clients)."""


class ServeConfig(StrictModel):
    """Network, access and lifecycle settings of one service process."""

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: anything else needs TLS (``tls_cert``/``tls_key``) and
    a token or client CA, or an explicit ``insecure``."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free port (printed at start and written to ``--port-file``)."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus metrics port on the same host; None turns the metrics endpoint off, 0 picks one.
    Plain HTTP without a token: read-only counters, meant for a scraper inside the cluster."""
    grace_seconds: float = Field(10.0, ge=0, le=3600)
    """On SIGTERM: seconds in-flight RPCs get to finish before they are cancelled."""
    term_linger_seconds: float = Field(0.0, ge=0, le=3600)
    """On a first SIGTERM, go on serving this long before shutting down (a second SIGTERM or
    SIGINT, or the end of the time, stops it). For schedulers that signal every process of a job
    at once (Slurm's ``scancel``): the coordinator, signalled too, still ends its step and gets
    its checkpoint from the learner. Keep it under the scheduler's kill timeout (Slurm's
    KillWait). 0: stop at the first signal."""
    max_message_mb: int = Field(256, ge=4, le=2048)
    """Largest gRPC message accepted or sent, in MiB (weight chunks and big batches need room)."""
    tls_cert: str | None = Field(None, min_length=1)
    """PEM certificate chain the server presents; with ``tls_key`` the service serves TLS only."""
    tls_key: str | None = Field(None, min_length=1)
    """PEM private key of ``tls_cert``."""
    tls_client_ca: str | None = Field(None, min_length=1)
    """PEM CA bundle; when set, callers must present a certificate it signed (mutual TLS)."""
    token_file: str | None = Field(None, min_length=1)
    """File holding the bearer token every call must carry (``authorization: Bearer <token>``);
    None: the file named by $RELAYRL_TOKEN_FILE, if set, else no token is asked for. Health checks
    and reflection stay open."""
    insecure: bool = False
    """Allow a non-loopback ``host`` without TLS or caller authentication (a trusted network, or a
    mesh that adds TLS in front). Off by default: such a service refuses to start."""

    @model_validator(mode="after")
    def _tls_pairs(self) -> ServeConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        return self


class ClientSecurity(StrictModel):
    """How a client reaches services: whom it trusts, its own certificate, its token. All unset:
    plaintext, no token (services on loopback)."""

    ca: str | None = Field(None, min_length=1)
    """PEM CA bundle that signed the services' certificates; set: every call goes over TLS."""
    cert: str | None = Field(None, min_length=1)
    """PEM client certificate presented for mutual TLS (with ``key``; needs ``ca``)."""
    key: str | None = Field(None, min_length=1)
    """PEM private key of ``cert``."""
    token_file: str | None = Field(None, min_length=1)
    """File holding the bearer token sent with every call; None: the file named by
    $RELAYRL_TOKEN_FILE, if set, else no token."""

    @model_validator(mode="after")
    def _pairs(self) -> ClientSecurity:
        if bool(self.cert) != bool(self.key):
            raise ValueError("cert and key go together: give both or neither")
        if self.cert and not self.ca:
            raise ValueError("a client certificate (mutual TLS) needs ca: it is only sent over TLS")
        return self
