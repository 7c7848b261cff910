"""The sandbox's fast checks: command lines, verdicts, config bounds, the probe refusing a sandbox
that cannot isolate (user namespaces blocked, simulated with a fake bwrap), and a few quick real
runs. The hostile programs are in tests/integration/test_sandbox_adversarial.py."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import time

import pytest
from pydantic import ValidationError
from relayrl.common.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
    SandboxUnsafe,
    Verdict,
    cgroups,
    probe,
    seccomp,
)
from relayrl.common.sandbox.cgroups import Cgroups, SlotCgroup
from relayrl.common.sandbox.runner import (
    bwrap_argv,
    check_files,
    looks_like_bwrap_failure,
    plain_argv,
    resolve_python,
    rlimit_args,
    verdict_of,
)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
USERNS_BLOCKED = (
    "bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
    "non-privileged user namespaces."
)


def test_rlimits_bind_every_resource():
    args = rlimit_args(SandboxLimits(cpu_seconds=2.0, memory_mb=512, processes=16, file_size_mb=16))
    assert args == [
        "--cpu=2:3",
        f"--as={512 << 20}",
        "--nproc=16",
        f"--fsize={16 << 20}",
        "--nofile=64",
        "--core=0",
    ]
    assert "--nproc=16" not in rlimit_args(SandboxLimits(), nproc=False)


def test_bwrap_command_isolates_everything():
    argv = bwrap_argv("bwrap", "/usr/bin/python3", SandboxLimits(tmp_mb=8), {"main.py": 5, "t.json": 6}, 7)
    assert argv[:5] == ["setpriv", "--pdeathsig", "KILL", "--", "bwrap"]
    rooted = bwrap_argv("bwrap", "/usr/bin/python3", SandboxLimits(), {"main.py": 5}, uid=61000)
    assert rooted[:10] == [
        "setpriv",
        "--reuid",
        "61000",
        "--regid",
        "61000",
        "--clear-groups",
        "--pdeathsig",
        "KILL",
        "--",
        "bwrap",
    ]
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"):
        assert flag in argv
    for flag in (
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ):
        assert flag in argv
    joined = " ".join(argv)
    assert "--cap-drop ALL" in joined and "--uid 65534 --gid 65534" in joined
    assert "--ro-bind /usr /usr" in joined and "--bind" not in joined.replace("--ro-bind", "")
    assert f"--size {8 << 20} --tmpfs /tmp" in joined and "--chdir /tmp" in joined
    assert "--file 5 /tmp/main.py --file 6 /tmp/t.json" in joined and "--json-status-fd 7" in joined
    assert joined.index("--remount-ro /dev --remount-ro / ") > joined.index(
        "--tmpfs /tmp"
    )  # only /tmp takes writes
    sandboxed = argv[argv.index("--") + 1 :]
    sandboxed = sandboxed[sandboxed.index("--") + 1 :]
    assert sandboxed[0] == "prlimit" and sandboxed[-5:] == [
        "/usr/bin/python3",
        "-I",
        "-S",
        "-B",
        "/tmp/main.py",
    ]
    assert "--share-net" not in argv and "/root" not in joined and "/home" not in joined


def test_without_proc():
    argv = bwrap_argv("bwrap", "/usr/bin/python3", SandboxLimits(), {"main.py": 5}, proc=False)
    assert "--proc" not in argv and "--tmpfs /dev" in " ".join(argv)


def test_the_jobs_dev_holds_no_pty():
    """bwrap's own --dev mounts a devpts with ptmx: every pty a job opens there comes from the
    kernel-wide pool (kernel.pty.max); the job's /dev holds only the plain devices."""
    argv = bwrap_argv("bwrap", "/usr/bin/python3", SandboxLimits(), {"main.py": 5})
    joined = " ".join(argv)
    assert "--dev " not in joined and "ptmx" not in joined and "pts" not in joined
    for name in ("null", "zero", "full", "random", "urandom"):
        assert f"--dev-bind /dev/{name} /dev/{name}" in joined


# ---- the seccomp filter, run by a classic-BPF interpreter (both architectures, on any machine)


def _run_filter(program: bytes, arch: int, nr: int, arg0: int = 0) -> tuple[str, int]:
    """What the kernel would do with system call ``nr`` of ``arch``: ("allow", 0) or ("errno", N)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    code = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    for _ in range(len(code)):  # forward jumps only: at most one pass
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif op == 0x06:  # ret k
            return ("allow", 0) if k == 0x7FFF0000 else ("errno", k & 0xFFFF)
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += 1 + (jt if taken else jf)
    raise AssertionError("the filter did not return")


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_the_filter_allows_only_the_socket_families_a_job_needs(machine):
    arch = seccomp.ARCHES[machine]
    program, nr = seccomp.filter_program(machine), arch.numbers
    for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
        assert _run_filter(program, arch.audit, nr["socket"], family) == ("allow", 0)
    for family in (40, socket.AF_NETLINK, socket.AF_PACKET, 31, 38, 29, 44, 0, 1 << 31):
        # AF_VSOCK, netlink, packet, Bluetooth, ALG, CAN, XDP, unspecified, garbage
        assert _run_filter(program, arch.audit, nr["socket"], family) == ("errno", errno.EAFNOSUPPORT)
    assert _run_filter(program, arch.audit, nr["socketpair"], socket.AF_UNIX) == ("allow", 0)
    assert _run_filter(program, arch.audit, nr["socketpair"], socket.AF_INET) == ("errno", errno.EAFNOSUPPORT)


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_the_filter_refuses_what_no_limit_counts(machine):
    arch = seccomp.ARCHES[machine]
    program = seccomp.filter_program(machine)
    for name in seccomp.REFUSED:  # io_setup and the rest of Linux AIO among them
        assert _run_filter(program, arch.audit, arch.numbers[name]) == ("errno", errno.EPERM), name
    clone = arch.numbers["clone"]
    assert _run_filter(program, arch.audit, clone, 0x10000000 | 17) == ("errno", errno.EPERM)
    assert _run_filter(program, arch.audit, clone, 0x01200011) == ("allow", 0)  # fork
    assert _run_filter(program, arch.audit, arch.numbers["clone3"]) == ("errno", errno.ENOSYS)
    assert _run_filter(program, arch.audit, 63) == ("allow", 0)  # read on aarch64, uname on x86-64
    assert _run_filter(program, 0x40000003, 41) == ("errno", errno.EPERM)  # i386 / another ABI
    if arch.foreign_from is not None:
        assert _run_filter(program, arch.audit, arch.foreign_from | 41) == ("errno", errno.EPERM)  # x32


@pytest.mark.parametrize(
    ("machine", "header"),
    [
        ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
        ("aarch64", "/usr/include/asm-generic/unistd.h"),
    ],
)
def test_the_filters_numbers_are_the_kernels(machine, header):
    if not os.path.exists(header):
        pytest.skip(f"{header} not installed (Debian's linux-libc-dev)")
    with open(header) as f:
        defined = dict(re.findall(r"#define __NR_(\w+)\s+(\d+)\b", f.read()))
    for name, nr in seccomp.ARCHES[machine].numbers.items():
        assert int(defined[name]) == nr, name


# ---- slot cgroups (a fake cgroup tree: the writes, not the kernel) ------------------------


def _fake_tree(root, version: int, own: str) -> str:
    if version == 2:
        d = os.path.join(root, own.lstrip("/"))
        os.makedirs(d)
        open(os.path.join(root, "cgroup.controllers"), "w").close()  # a unified hierarchy
        for name, text in {
            "cgroup.controllers": "cpuset cpu io memory pids",
            "cgroup.subtree_control": "",
        }.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
        return f"0::{own}\n"
    for c in ("memory", "cpu"):
        d = os.path.join(root, c, own.lstrip("/"))
        os.makedirs(d)
        open(os.path.join(d, "cgroup.procs"), "w").close()
    return f"5:pids:/\n4:memory:{own}\n2:cpu,cpuacct:{own}\n0::/\n"


@pytest.mark.parametrize("version", [1, 2])
def test_slot_cgroups_bound_the_whole_job(tmp_path, version):
    own = "/service/abc"
    found, detail = Cgroups.find(str(tmp_path), _fake_tree(str(tmp_path), version, own))
    assert found is not None and found.version == version, detail
    slot = found.make("relayrl-sandbox-u61000")
    slot.apply(SandboxLimits(memory_mb=256, tmp_mb=16, processes=8, cpus=1.5))

    def read(controller, name):
        with open(os.path.join(slot.dirs[controller], name)) as f:
            return f.read()

    if version == 2:
        assert read("memory", "memory.max") == str(336 << 20)
        assert read("cpu", "cpu.max") == "150000 100000"
        with open(os.path.join(tmp_path, "service/abc/cgroup.subtree_control")) as f:
            assert f.read() == "+memory +cpu"  # delegated to the slots
    else:
        assert read("memory", "memory.limit_in_bytes") == str(336 << 20)
        assert read("cpu", "cpu.cfs_quota_us") == "150000"
    argv = slot.join_argv(["setpriv", "--", "bwrap"])
    procs = sorted({os.path.join(d, "cgroup.procs") for d in slot.dirs.values()})
    assert argv[:3] == ["/bin/sh", "-c", cgroups._JOIN] and argv[4:] == [
        *procs,
        "--",
        "setpriv",
        "--",
        "bwrap",
    ]


def test_no_slot_cgroups_where_none_can_be_made(tmp_path):
    found, detail = Cgroups.find(str(tmp_path), "0::/service\n")
    assert found is None and "cgroup v2" in detail and "cgroup v1" in detail


def test_the_join_runs_the_command_inside(tmp_path):
    """The job's first process writes its own pid, then is the command (same pid: exec)."""
    procs = tmp_path / "cgroup.procs"
    slot = SlotCgroup(2, {"memory": str(tmp_path)}, {})
    out = subprocess.run(slot.join_argv(["sh", "-c", "echo $$"]), capture_output=True, text=True, check=True)
    assert procs.read_text().strip() == out.stdout.strip()
    failing = SlotCgroup(2, {"memory": str(tmp_path / "gone")}, {})
    bad = subprocess.run(failing.join_argv(["true"]), capture_output=True)
    assert looks_like_bwrap_failure(bad.returncode, bad.stdout, bad.stderr)  # infrastructure


def test_plain_command():
    argv = plain_argv("/usr/bin/python3", SandboxLimits(), nproc=True)
    assert argv[4] == "prlimit" and argv[-1] == "main.py" and "--nproc=16" in argv


@pytest.mark.parametrize(
    "returncode, stderr, flags, expected",
    [
        (0, "", {}, (Verdict.OK, 0, None)),
        (3, "", {}, (Verdict.CRASHED, 3, None)),
        (1, "Traceback (most recent call last):\n  ...\nValueError: x\n", {}, (Verdict.CRASHED, 1, None)),
        (1, "Traceback (most recent call last):\n  ...\nMemoryError\n\n", {}, (Verdict.MEMORY, 1, None)),
        (1, "numpy.core._exceptions._ArrayMemoryError: Unable to allocate\n", {}, (Verdict.MEMORY, 1, None)),
        (0, "MemoryError\n", {}, (Verdict.OK, 0, None)),
        (128 + signal.SIGKILL, "", {}, (Verdict.KILLED, None, signal.SIGKILL)),
        (128 + signal.SIGSEGV, "", {}, (Verdict.KILLED, None, signal.SIGSEGV)),
        (128 + signal.SIGXCPU, "", {}, (Verdict.TIMEOUT, None, signal.SIGXCPU)),
        (-signal.SIGKILL, "", {"timed_out": True}, (Verdict.TIMEOUT, None, signal.SIGKILL)),
        (-signal.SIGKILL, "", {"truncated": True}, (Verdict.OUTPUT_TRUNCATED, None, signal.SIGKILL)),
        (-signal.SIGSEGV, "", {}, (Verdict.KILLED, None, signal.SIGSEGV)),
    ],
)
def test_verdicts(returncode, stderr, flags, expected):
    kw = {"timed_out": False, "truncated": False, **flags}
    assert verdict_of(returncode, stderr, via_bwrap=True, **kw) == expected


def test_plain_tier_reads_high_exit_codes_as_codes():
    assert verdict_of(137, "", timed_out=False, truncated=False, via_bwrap=False) == (
        Verdict.CRASHED,
        137,
        None,
    )


def test_bwrap_failure_shape():
    assert looks_like_bwrap_failure(1, b"", USERNS_BLOCKED.encode() + b"\n")
    assert not looks_like_bwrap_failure(1, b"out", USERNS_BLOCKED.encode())
    assert not looks_like_bwrap_failure(1, b"", b"Traceback\nbwrap: x\n")
    assert not looks_like_bwrap_failure(2, b"", USERNS_BLOCKED.encode())
    assert looks_like_bwrap_failure(
        127, b"", b"setpriv: failed to execute bwrap: No such file or directory\n"
    )


def test_limits_and_config_bounds():
    assert SandboxLimits().model_dump() == {
        "wall_seconds": 5.0,
        "cpu_seconds": 2.0,
        "memory_mb": 512,
        "processes": 16,
        "file_size_mb": 16,
        "output_bytes": 65536,
        "tmp_mb": 16,
        "open_files": 64,
        "cpus": 1.0,
    }
    for bad in (
        {"wall_seconds": 0},
        {"memory_mb": 8},
        {"processes": 1},
        {"output_bytes": 10},
        {"cpus": 0},
        {"nope": 1},
    ):
        with pytest.raises(ValidationError):
            SandboxLimits(**bad)
    with pytest.raises(ValidationError):
        SandboxLimits().wall_seconds = 3.0  # frozen: shared defaults cannot be changed in place
    with pytest.raises(ValidationError):
        SandboxConfig(tier="docker")
    with pytest.raises(ValidationError):
        SandboxConfig(cgroups="maybe")
    assert SandboxConfig(tier="rlimits-only", limits={"wall_seconds": 1}).limits.wall_seconds == 1


def test_files_and_python_checked():
    assert check_files({"tests.json": "[]"}) == {"tests.json": "[]"}
    for bad in ({"main.py": ""}, {"../x": ""}, {"a/b": ""}, {"": ""}, {".hidden": ""}):
        with pytest.raises(ValueError):
            check_files(bad)
    with pytest.raises(ValueError, match="under /usr"):
        resolve_python("/root/.pyenv/bin/python3")
    with pytest.raises(ValueError):
        resolve_python("/usr/../root/python3")
    with pytest.raises(ValueError):
        Sandbox(tier="docker")


@pytest.fixture
def fake_bwrap():
    """A bwrap that fails as it does where user namespaces are blocked. In a folder every user can
    read: as root the sandbox starts bwrap as a user of its own."""
    folder = tempfile.mkdtemp(prefix="relayrl-fake-bwrap-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "bwrap")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho '{USERNS_BLOCKED}' >&2\nexit 1\n")
    os.chmod(path, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    yield path
    shutil.rmtree(folder)


def test_probe_refuses_when_user_namespaces_are_blocked(fake_bwrap):
    sandbox = Sandbox(bwrap=fake_bwrap)
    with pytest.raises(SandboxUnavailable, match="No permissions to creating new namespace"):
        sandbox.run_sync("print(1)")
    with pytest.raises(SandboxUnsafe, match="cannot run code.*No permissions"):
        probe(sandbox)


def test_probe_refuses_a_missing_bwrap():
    with pytest.raises(SandboxUnsafe, match="cannot run code.*no-such-bwrap"):
        probe(Sandbox(bwrap="/usr/bin/no-such-bwrap"))


def test_rlimits_only_reports_what_it_lacks():
    report = probe(Sandbox("rlimits-only"))
    assert report.tier == "rlimits-only" and not report.isolated
    assert {c.name for c in report.failed} >= {"network", "processes", "userns"}
    by_name = {c.name: c for c in report.checks}
    assert by_name["memory"].ok
    if os.geteuid() == 0:  # a user of its own: the process limit binds
        assert by_name["fork"].ok


@needs_bwrap
def test_full_probe_passes_here():
    report = probe("full")
    assert report.isolated, report.summary()
    assert [c.name for c in report.checks] == ["network", "memory", "fork", "processes", "userns", "kernel"]


@needs_bwrap
def test_a_program_printing_a_bwrap_error_is_not_an_infrastructure_failure():
    result = Sandbox().run_sync(f"import sys\nsys.stderr.write({USERNS_BLOCKED!r} + '\\n')\nsys.exit(1)")
    assert result.verdict is Verdict.CRASHED and result.exit_code == 1


@needs_bwrap
@pytest.mark.parametrize("tier", ["full", "rlimits-only"])
def test_runs_code_with_stdin_files_and_exit_codes(tier):
    sandbox = Sandbox(tier)
    code = "import json, sys\nprint(sum(json.load(open('t.json'))) + int(input()))\nsys.exit(4)"
    result = sandbox.run_sync(code, stdin="5\n", files={"t.json": "[1, 2, 3]"})
    assert (result.verdict, result.exit_code, result.stdout) == (Verdict.CRASHED, 4, "11\n")
    result = sandbox.run_sync("raise KeyError('k')")
    assert result.verdict is Verdict.CRASHED and result.stderr.rstrip().endswith("KeyError: 'k'")
    ok = sandbox.run_sync("import os\nprint(os.getcwd(), os.environ.get('PATH'))")
    assert ok.verdict is Verdict.OK and not ok.truncated and ok.signal is None
    if tier == "full":
        assert ok.stdout == "/tmp /usr/bin:/bin\n"


@needs_bwrap
async def test_at_most_workers_at_once():
    sandbox = Sandbox(workers=2)
    code = "import time\ntime.sleep(0.4)\nprint('done')"
    start = time.monotonic()
    results = await asyncio.gather(*(sandbox.run(code) for _ in range(4)))
    elapsed = time.monotonic() - start
    assert all(r.verdict is Verdict.OK and r.stdout == "done\n" for r in results)
    assert 0.8 <= elapsed < 3.0  # two rounds of two
    sandbox.close()
