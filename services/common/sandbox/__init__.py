"""Run untrusted Python (a model's code) contained: bubblewrap namespaces + rlimits, one job per
worker, every outcome named. Used by the env service (tools) and the reward service (code
rewards); knows no service.

    sandbox = Sandbox.from_config(config.sandbox)
    report = probe(sandbox)          # SandboxUnsafe when isolation is missing (tier "full")
    result = await sandbox.run("print(input())", stdin="hi")   # RunResult(verdict=OK, ...)

Importing this package starts nothing (only the standard library and pydantic).
"""

from relayrl.common.sandbox.limits import (
    RunResult,
    SandboxBusy,
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
    SandboxUnsafe,
    Tier,
    Verdict,
)
from relayrl.common.sandbox.packages import PackagesError
from relayrl.common.sandbox.pool import Sandbox
from relayrl.common.sandbox.probe import ProbeReport, probe

__all__ = [
    "PackagesError",
    "ProbeReport",
    "RunResult",
    "Sandbox",
    "SandboxBusy",
    "SandboxConfig",
    "SandboxLimits",
    "SandboxUnavailable",
    "SandboxUnsafe",
    "Tier",
    "Verdict",
    "probe",
]
