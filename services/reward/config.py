"""Configuration of the reward service (stateless scoring)."""

from __future__ import annotations

from pydantic import Field, field_validator
from relayrl.common.config import StrictModel, plugin_refs
from relayrl.common.sandbox.limits import SandboxConfig
from relayrl.common.serving import ServeConfig


class RewardConfig(StrictModel):
    """One reward replica."""

    serve: ServeConfig = Field(default_factory=ServeConfig)
    """Where the replica listens."""
    workers: int = Field(2, ge=1, le=512)
    """Scoring processes: CPU-bound verifiers run there, out of the server's event loop."""
    timeout_seconds: float = Field(5.0, gt=0, le=600)
    """Per-sample scoring limit; past it the sample gets status TIMEOUT and the worker is replaced."""
    plugins: list[str] = Field(default_factory=list)
    """User scorers as ``module:function``; each serves the data sources it declares."""
    sandbox: SandboxConfig | None = None
    """The sandbox of the ``code`` reward (programs run against tests). Set: every scoring worker
    starts it and probes it before it reports ready, so a replica without isolation (tier
    ``full``) refuses to start; give ``timeout_seconds`` room for a sample's tests. Unset: a
    worker starts a default one (tier ``full``, unprobed) on its first ``code`` sample."""
    max_items_per_request: int = Field(65536, ge=1)
    """Most samples one Score call may carry; more is INVALID_ARGUMENT."""
    max_pending_items: int = Field(262144, ge=1)
    """Samples queued or being scored over all calls; a call that would go past it is
    RESOURCE_EXHAUSTED (retry later, or on another replica) instead of waiting without bound."""
    max_text_chars: int = Field(1 << 20, ge=1)
    """Longest completion, ground truth or prompt of one sample, in characters."""
    respawn_failures_unready: int = Field(3, ge=1, le=1000)
    """Failed starts in a row of a scoring worker (retried with backoff, 0.1 s doubling to 10 s)
    after which, with no worker up, the replica reports NOT_SERVING and Score calls fail
    UNAVAILABLE with the reason; it serves again as soon as a worker starts."""
    respawn_give_up_seconds: float = Field(300.0, gt=0, le=86400)
    """How long a scoring worker may keep failing to start (once past respawn_failures_unready)
    before the process exits with status 1, for its supervisor to restart it."""

    @field_validator("plugins")
    @classmethod
    def _plugin_refs(cls, v: list[str]) -> list[str]:
        return plugin_refs(v, "function")
