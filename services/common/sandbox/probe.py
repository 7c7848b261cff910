"""The fail-loud start-up probe: before a service serves, check that the sandbox contains code.

A program that prints "ok" must run (else: the sandbox cannot run code at all); then six hostile
programs run in the sandbox under its own limits (the wall clock raised to 5 s):

* ``network``: the host listens on a free port of its own 127.0.0.1; the program looks up each of
  the host's interfaces by name and connects to that port. Nothing may arrive and only ``lo`` may
  be found. No other address is ever tried.
* ``memory``: a 1 GiB allocation (twice the limit when that is larger) must fail (MEMORY).
* ``fork``: forking up to 4x the process limit must stop before the limit, and the host must
  still start a process afterwards.
* ``processes``: /proc must show only the sandbox's own pids, and the program must not be root.
* ``userns``: a nested user namespace (where the job would be root again) must be refused.
* ``kernel``: what the seccomp filter and the job's /dev refuse must be refused: sockets of the
  families that ignore network namespaces or are kernel surface (AF_VSOCK reaches a VM's
  hypervisor; AF_NETLINK, AF_PACKET), Linux AIO (the host-wide ``fs.aio-max-nr``), and a pty
  (``/dev/ptmx``, the kernel-wide pty pool). A machine where the filter is missing a rule (or is
  not built, on another architecture) fails here.

Whether jobs are also bounded as a whole (a slot cgroup: memory with socket buffers, processes,
CPU) is reported beside the checks (``ProbeReport.cgroups``); ``sandbox.cgroups: required``
already refused to build a sandbox without one.

Tier ``full`` raises ``SandboxUnsafe`` naming every failed check (and when the sandbox cannot
start at all); tier ``rlimits-only`` was chosen knowing that ``network`` and ``processes`` fail,
so it reports and logs what holds and raises only when nothing can run.
"""

from __future__ import annotations

import json
import logging
import platform
import socket
import subprocess
import time
from dataclasses import dataclass, field

from relayrl.common.sandbox.limits import SandboxUnavailable, SandboxUnsafe, Tier, Verdict
from relayrl.common.sandbox.pool import Sandbox
from relayrl.common.sandbox.seccomp import ARCHES

logger = logging.getLogger(__name__)

_NETWORK = """
import json, socket
r = {"interfaces": []}
for name in NAMES:
    try:
        socket.if_nametoindex(name)
        r["interfaces"].append(name)
    except OSError:
        pass
s = socket.socket()
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", PORT))
    r["connect"] = "connected"
except OSError as e:
    r["connect"] = type(e).__name__
print(json.dumps(r))
"""
_MEMORY = "b = bytearray(SIZE)\nprint(len(b))\n"
_FORK = """
import os, time
n, blocked = 0, False
try:
    for _ in range(TRIES):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    blocked = True
print(n, blocked, flush=True)
"""
_USERNS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), ctypes.get_errno())
"""
_KERNEL = """
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
r = {}
for family in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET"):
    try:
        socket.socket(getattr(socket, family), socket.SOCK_DGRAM).close()
        r[family] = "created"
    except OSError as e:
        r[family] = errno.errorcode.get(e.errno, str(e.errno))
ctx = ctypes.c_ulong(0)
r["io_setup"] = "created" if libc.syscall(IO_SETUP, 1, ctypes.byref(ctx)) == 0 else "refused"
try:
    os.close(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    r["ptmx"] = "opened"
except OSError as e:
    r["ptmx"] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(r))
"""
_PROCESSES = """
import os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else []
print(os.getuid(), pids)
"""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


@dataclass
class ProbeReport:
    """What the probe found: the tier in use and each check's outcome and time."""

    tier: Tier
    python: str
    checks: list[Check] = field(default_factory=list)
    cgroups: str = ""
    """How jobs are bounded as a whole: the slot cgroups in use, or why there are none."""

    @property
    def isolated(self) -> bool:
        """Every check passed."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def summary(self) -> str:
        parts = [f"{c.name} {'ok' if c.ok else 'FAILED'} ({c.seconds * 1000:.0f} ms)" for c in self.checks]
        return f"sandbox tier {self.tier}: " + ", ".join(parts) + f"; jobs bounded as a whole: {self.cgroups}"


def probe(sandbox: Sandbox | Tier = "full") -> ProbeReport:
    """Run the checks in ``sandbox`` (or in a default one of that tier). Raises SandboxUnsafe for
    tier ``full`` when a check fails or the sandbox does not start."""
    if isinstance(sandbox, str):
        own = Sandbox(sandbox)
        try:
            return probe(own)
        finally:
            own.close()
    report = ProbeReport(sandbox.tier, sandbox.python, cgroups=sandbox.cgroups)
    try:
        hello = sandbox.run_sync("print('ok')", limits=_limits(sandbox))
        if (hello.verdict, hello.stdout) != (Verdict.OK, "ok\n"):
            raise SandboxUnavailable(
                f"a program that prints 'ok' ended {hello.verdict}: {hello.stderr.strip()[:300]}"
            )
        for check in (_network, _memory, _fork, _processes, _userns, _kernel):
            start = time.monotonic()
            ok, detail = check(sandbox)
            report.checks.append(Check(check.__name__.lstrip("_"), ok, detail, time.monotonic() - start))
    except SandboxUnavailable as e:
        raise SandboxUnsafe(f"sandbox tier {sandbox.tier} cannot run code: {e}") from e
    if report.tier == "full" and not report.isolated:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in report.failed)
        raise SandboxUnsafe(
            f"sandbox isolation missing ({failed}); install bubblewrap and allow user namespaces, "
            "or choose sandbox.tier: rlimits-only knowingly"
        )
    if report.failed:
        logger.warning("%s; not isolated: %s", report.summary(), ", ".join(c.name for c in report.failed))
    else:
        logger.info("%s", report.summary())
    return report


def _limits(sandbox: Sandbox):
    return sandbox.limits.model_copy(update={"wall_seconds": max(sandbox.limits.wall_seconds, 5.0)})


def _network(sandbox: Sandbox) -> tuple[bool, str]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        names = repr(sorted(name for _, name in socket.if_nameindex()))
        code = _NETWORK.replace("PORT", str(port)).replace("NAMES", names)
        result = sandbox.run_sync(code, limits=_limits(sandbox))
        try:
            conn, _ = listener.accept()
            conn.close()
            arrived = True
        except BlockingIOError:
            arrived = False
    try:
        seen = json.loads(result.stdout)
    except ValueError:
        return False, f"the check did not run: {result.verdict} {result.stderr.strip()[-200:]}"
    ok = not arrived and seen["connect"] != "connected" and seen["interfaces"] == ["lo"]
    return (
        ok,
        f"host listener reached: {arrived}; connect: {seen['connect']}; interfaces: {seen['interfaces']}",
    )


def _memory(sandbox: Sandbox) -> tuple[bool, str]:
    size = max(1 << 30, 2 * sandbox.limits.memory_mb << 20)
    result = sandbox.run_sync(_MEMORY.replace("SIZE", str(size)), limits=_limits(sandbox))
    return result.verdict is Verdict.MEMORY, f"{size >> 20} MiB allocation: {result.verdict}"


def _fork(sandbox: Sandbox) -> tuple[bool, str]:
    limit = sandbox.limits.processes
    result = sandbox.run_sync(_FORK.replace("TRIES", str(4 * limit)), limits=_limits(sandbox))
    try:
        forked, blocked = result.stdout.split()
    except ValueError:
        return False, f"the check did not run: {result.verdict} {result.stderr.strip()[-200:]}"
    host = subprocess.run(["true"], check=False).returncode == 0
    ok = blocked == "True" and int(forked) < limit and host
    return ok, f"forks before refusal: {forked} (limit {limit}); host can still fork: {host}"


def _processes(sandbox: Sandbox) -> tuple[bool, str]:
    result = sandbox.run_sync(_PROCESSES, limits=_limits(sandbox))
    try:
        uid, pids = result.stdout.split(" ", 1)
        pids = json.loads(pids)
    except ValueError:
        return False, f"the check did not run: {result.verdict} {result.stderr.strip()[-200:]}"
    ok = int(uid) != 0 and len(pids) <= 3
    return ok, f"uid inside: {uid}; pids visible: {len(pids)}"


def _userns(sandbox: Sandbox) -> tuple[bool, str]:
    result = sandbox.run_sync(_USERNS, limits=_limits(sandbox))
    refused = result.stdout.startswith("-1 ")
    return refused, f"unshare(CLONE_NEWUSER): {'refused' if refused else 'allowed'} ({result.stdout.strip()})"


def _kernel(sandbox: Sandbox) -> tuple[bool, str]:
    arch = ARCHES.get(platform.machine())
    if arch is None:
        return False, f"no seccomp filter is built for {platform.machine()}"
    code = _KERNEL.replace("IO_SETUP", str(arch.numbers["io_setup"]))
    result = sandbox.run_sync(code, limits=_limits(sandbox))
    try:
        seen = json.loads(result.stdout)
    except ValueError:
        return False, f"the check did not run: {result.verdict} {result.stderr.strip()[-200:]}"
    allowed = [k for k, v in seen.items() if v in ("created", "opened")]
    detail = ", ".join(f"{k}: {v}" for k, v in seen.items())
    return not allowed, (f"allowed: {', '.join(allowed)} ({detail})" if allowed else detail)
