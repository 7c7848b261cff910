"""Hostile programs against the full sandbox tier (issue 30): each must end within its limit + 1 s
with the right verdict, and leave the host unharmed: this test process and a canary process on the
host still alive, nothing arrived at a listener on the host's loopback, no file written outside the
sandbox, and no process of the job left (as root, every job runs as a host user of its own: none
of that user's processes may remain). Targets only 127.0.0.1 of this machine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time

import pytest
from relayrl.common.sandbox import Sandbox, SandboxLimits, Verdict
from relayrl.common.sandbox.procs import pids_of_user

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1.0, memory_mb=512, processes=16, output_bytes=65536)
UID_BASE = 61000
WORKERS = 2


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox("full", LIMITS, workers=WORKERS, uid_base=UID_BASE)
    yield box
    box.close()


@pytest.fixture(scope="module")
def canary():
    """A host process that must outlive every case."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def host(canary, sandbox):
    """After each case: the canary lives, this process can still start one, no job process is
    left (as root: by the slots' users)."""
    yield
    assert canary.poll() is None, "the host canary was killed"
    assert subprocess.run(["true"], check=False).returncode == 0, "the host cannot start a process"
    if os.geteuid() == 0:
        assert len(sandbox.uids) == WORKERS  # users of its own, locked: another run never shares them
        left = [p for uid in sandbox.uids for p, zombie in pids_of_user(uid) if not zombie]
        assert left == [], f"processes of the job survive: {[_describe(p) for p in left[:3]]} of {len(left)}"


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return " ".join(f"{k}={fields[k].split()}" for k in ("State", "PPid", "Uid", "NSpid") if k in fields)
    except OSError as e:
        return f"{pid}: {e}"


def timed(sandbox: Sandbox, code: str, **kw):
    start = time.monotonic()
    result = sandbox.run_sync(code, **kw)
    return result, time.monotonic() - start


def test_fork_bomb(sandbox, host):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result, took = timed(sandbox, code)
    assert result.verdict is Verdict.TIMEOUT, result
    assert took <= LIMITS.wall_seconds + 1


FORK_ONCE = "import os\npid = os.fork()\nif pid == 0:\n    print('forked', flush=True)\n    os._exit(0)\nos.waitpid(pid, 0)\n"


def test_fork_bomb_leaves_the_other_worker_alone(sandbox, host):
    async def both():
        bomb = asyncio.ensure_future(
            sandbox.run(
                "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
            )
        )
        await asyncio.sleep(0.3)
        quiet = await sandbox.run(FORK_ONCE)
        return await bomb, quiet

    bomb, quiet = asyncio.run(both())
    assert bomb.verdict is Verdict.TIMEOUT and quiet.verdict is Verdict.OK and quiet.stdout == "forked\n"


def test_counted_forks_stop_at_the_process_limit(sandbox, host):
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
        "    print(n, type(e).__name__)\n"
    )
    result, took = timed(sandbox, code)
    forked, error = result.stdout.split()
    assert result.verdict is Verdict.OK and error == "BlockingIOError" and int(forked) < LIMITS.processes
    assert took < 1.0  # the sleeping children die with the program


def test_busy_loop(sandbox, host):
    result, took = timed(sandbox, "while True:\n    pass\n")
    assert result.verdict is Verdict.TIMEOUT, result
    assert took <= LIMITS.cpu_seconds + 1


@pytest.mark.parametrize(
    "code",
    ["b = bytearray(2 << 30)", "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"],
    ids=["2GiB-at-once", "1MiB-at-a-time"],
)
def test_allocation(sandbox, host, code):
    result, took = timed(sandbox, code)
    assert result.verdict is Verdict.MEMORY, result
    assert took <= LIMITS.wall_seconds + 1


def test_no_network(sandbox, host):
    code = """
import socket
print(sorted(n for _, n in socket.if_nameindex()))
for family, addr in ((socket.AF_INET, ("127.0.0.1", PORT)), (socket.AF_INET6, ("::1", PORT))):
    s = socket.socket(family)
    s.settimeout(1)
    try:
        s.connect(addr)
        print("connected")
    except OSError as e:
        print(type(e).__name__)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"x", ("127.0.0.1", PORT))
    print("sent")
except OSError as e:
    print(type(e).__name__)
"""
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        tcp.setblocking(False)
        port = tcp.getsockname()[1]
        udp.bind(("127.0.0.1", port))
        udp.setblocking(False)
        result, took = timed(sandbox, code.replace("PORT", str(port)))
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            udp.recvfrom(16)
    lines = result.stdout.splitlines()
    assert lines[0] == "['lo']" and "connected" not in lines, result
    assert took <= LIMITS.wall_seconds + 1


def test_writes_outside_tmp(sandbox, host, tmp_path):
    marker = f"relayrl-sandbox-{os.getpid()}"
    code = f"""
import os
for path in ("/usr/{marker}", "/{marker}", "/etc/{marker}", "/proc/{marker}", "/dev/{marker}", "/dev/shm/{marker}",
             "/root/{marker}",
             "{tmp_path}/{marker}"):
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
with open("/tmp/ok", "w") as f:
    f.write("fine")
with open("/dev/null", "w") as f:
    f.write("fine")
try:
    with open("/tmp/big", "wb") as f:
        f.write(b"0" * (64 << 20))
    print("wrote big")
except OSError as e:
    print("refused big", type(e).__name__)
"""
    result, took = timed(sandbox, code)
    assert "wrote" not in result.stdout.replace("refused", ""), result
    for path in (f"/usr/{marker}", f"/{marker}", f"/etc/{marker}", f"/root/{marker}", tmp_path / marker):
        assert not os.path.exists(path)
    assert result.verdict is Verdict.OK and took <= LIMITS.wall_seconds + 1


def test_reads_of_host_secrets_and_processes(sandbox, host):
    me = os.getpid()
    code = f"""
import os
for path in ("/etc/shadow", "/etc/passwd", "/root", "/proc/{me}/environ", "/proc/{me}/status", "/work", "/home"):
    try:
        print("read", path, len(open(path).read()) if not os.path.isdir(path) else os.listdir(path))
    except OSError as e:
        print("refused", path, type(e).__name__)
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("uid", os.getuid(), "init", open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode())
"""
    result, took = timed(sandbox, code)
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith("read")], result
    pids = json.loads(lines[-2].split(" ", 1)[1])
    assert len(pids) <= 3 and me not in pids
    assert (
        lines[-1] in ("uid 65534 init bwrap", f"uid 65534 init {sandbox.bwrap}")
        and result.verdict is Verdict.OK
    )


def test_setsid_and_kill_everything(sandbox, host):
    code = """
import os, signal, time
if os.fork() == 0:
    time.sleep(30)
    os._exit(0)
os.setsid()
os.kill(-1, signal.SIGKILL)
for pid in (1, os.getppid()):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as e:
        print(type(e).__name__)
time.sleep(0.1)
print("alive")
"""
    result, took = timed(sandbox, code)
    assert result.stdout.endswith("alive\n") and result.verdict is Verdict.OK, result
    assert took <= LIMITS.wall_seconds + 1


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_flood_of_output(sandbox, host, stream):
    code = (
        f"import sys\nchunk = 'x' * 65536\nfor _ in range(1600):\n    sys.{stream}.write(chunk)\n"  # 100 MB
    )
    result, took = timed(sandbox, code)
    assert result.verdict is Verdict.OUTPUT_TRUNCATED and result.truncated, result
    assert len(getattr(result, stream)) == LIMITS.output_bytes
    assert took <= LIMITS.wall_seconds + 1


def test_sleep_past_the_deadline(sandbox, host):
    result, took = timed(sandbox, "import time\ntime.sleep(60)\n")
    assert result.verdict is Verdict.TIMEOUT and result.signal == 9
    assert LIMITS.wall_seconds <= took <= LIMITS.wall_seconds + 1


@pytest.mark.parametrize("holds_stdout", [True, False])
def test_child_left_behind(sandbox, host, holds_stdout):
    code = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if not {holds_stdout}:
            os.close(1)
            os.close(2)
        time.sleep(60)
    os._exit(0)
print("parent done")
"""
    result, took = timed(sandbox, code)
    assert result.verdict is Verdict.OK and result.stdout == "parent done\n", result
    assert took < 1.0  # the program's end ends its namespace: nothing waits for the daemon


def test_memory_no_rlimit_counts_is_refused(sandbox, host):
    """System V shared memory outlives its mapping, a memfd grows by write(), a POSIX message
    queue lives in the kernel: none counts against RLIMIT_AS, so the seccomp filter refuses them."""
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("shmget", libc.shmget(0, 256 << 20, 0o1600), ctypes.get_errno())
print("msgget", libc.msgget(0, 0o1600), ctypes.get_errno())
print("mq_open", ctypes.CDLL("librt.so.1", use_errno=True).mq_open(b"/q", 0o100, 0o600, None), ctypes.get_errno())
try:
    os.memfd_create("hoard")
    print("memfd created")
except OSError as e:
    print("memfd", e.errno)
"""
    result, took = timed(sandbox, code)
    assert result.stdout.splitlines() == ["shmget -1 1", "msgget -1 1", "mq_open -1 1", "memfd 1"], result
    assert took <= LIMITS.wall_seconds + 1


@pytest.mark.parametrize("proc", [True, False])
def test_no_nested_user_namespace(host, proc):
    """In a user namespace of its own the job would be root again (and could mount an unsized
    tmpfs): refused with /proc (bwrap's --disable-userns and the filter) and without (the filter)."""
    box = Sandbox("full", LIMITS, workers=1, proc=proc)
    try:
        code = (
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
            "print(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"  # raw clone
        )
        result, took = timed(box, code)
        assert result.stdout.splitlines() == ["-1 1", "-1 1"], result
        assert took <= LIMITS.wall_seconds + 1
    finally:
        box.close()
