"""Python packages for sandboxed programs: a requirements file installed once, for the sandbox's
own interpreter, into a folder that jobs get mounted read-only (a harness env's agent written with
a framework: LangChain, the OpenAI SDK, pydantic-ai...).

One folder per (requirements text, interpreter version, machine) under the cache root, so
replicas on one host and runs after the first share it; a file lock keeps two processes from
building the same one. pip runs on the host with ``--only-binary=:all:``: wheels only, so no
package's build code runs at install time, and the wheels are chosen for the sandbox's interpreter
(``--python-version``), which is not the service's. A requirements file may carry pip's own options
(``--index-url``, ``--find-links``, ``--no-index``) for private indexes or offline wheel folders.
When done the folder is made read-only and world-readable (the sandbox's users are not the
service's).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

MAX_REQUIREMENTS_BYTES = 64 << 10
MAX_ERROR_CHARS = 2000
COMPLETE = ".relayrl-complete"
"""Written last into a finished folder: a folder without it is a build that did not end."""


class PackagesError(RuntimeError):
    """The requirements could not be installed (pip's error, cut, is in the message)."""


def default_root() -> Path:
    """``/var/cache/relayrl/sandbox-packages`` for a service run as root (its jobs run as users of
    their own, who must reach the folder: a root's home is closed to them), else
    ``$XDG_CACHE_HOME/relayrl/sandbox-packages`` (``~/.cache`` without it)."""
    if os.geteuid() == 0:
        return Path("/var/cache/relayrl/sandbox-packages")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "relayrl" / "sandbox-packages"


def check_reachable(folder: Path) -> None:
    """PackagesError unless other users can reach ``folder`` (every folder above it open to them:
    a service run as root runs its jobs as users of their own, and bubblewrap mounts the folder as
    the job's user)."""
    if os.geteuid() != 0:
        return
    for above in [folder, *folder.parents]:
        mode = above.stat().st_mode
        if not mode & 0o001:
            raise PackagesError(
                f"the sandbox's users cannot reach {folder}: {above} is closed to other users "
                f"(mode {oct(mode & 0o777)}); set sandbox.packages_dir to a folder they can reach"
            )


def interpreter_version(python: str) -> str:
    """``python``'s ``X.Y``.

    >>> interpreter_version(sys.executable) == "%d.%d" % sys.version_info[:2]
    True
    """
    out = subprocess.run(
        [python, "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def folder_name(requirements: str, version: str) -> str:
    """The folder a requirements text installs into for interpreter ``version``: stable, and
    distinct per text, version and machine.

    >>> folder_name("openai==2.0", "3.11") == folder_name("openai==2.0", "3.11")
    True
    >>> folder_name("openai==2.0", "3.11") != folder_name("openai==2.0", "3.12")
    True
    """
    key = f"{version}\n{platform.machine()}\n{requirements}".encode()
    return f"py{version}-{hashlib.sha256(key).hexdigest()[:16]}"


def install(requirements: str, python: str, root: Path | None = None, timeout: float = 900.0) -> Path:
    """The folder holding ``requirements`` (a requirements file's text) installed for the
    interpreter ``python``; built on first use (``timeout`` seconds at most, waiting on another
    process's build included), then reused. ``PackagesError`` when pip fails or overruns."""
    if len(requirements.encode()) > MAX_REQUIREMENTS_BYTES:
        raise PackagesError(f"a requirements file of at most {MAX_REQUIREMENTS_BYTES} bytes, got more")
    root = Path(root) if root is not None else default_root()
    version = interpreter_version(python)
    dest = root / folder_name(requirements, version)
    if (dest / COMPLETE).exists():
        check_reachable(dest)
        return dest
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    check_reachable(root)
    end = time.monotonic() + timeout
    with open(root / f"{dest.name}.lock", "w") as lock:
        _lock(lock, end)
        if (dest / COMPLETE).exists():  # built by the process we waited for
            return dest
        _build(requirements, version, dest, end)
    return dest


def _lock(f, end: float) -> None:
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise PackagesError(
                    "timed out waiting for another process installing the same packages"
                ) from None
            time.sleep(0.2)


def _build(requirements: str, version: str, dest: Path, end: float) -> None:
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)  # a folder without COMPLETE: an interrupted rename
    partial.mkdir(parents=True)
    req = partial / "requirements.txt"
    req.write_text(requirements)
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
        "--no-compile", "--target", str(partial), "--python-version", version, "--only-binary=:all:",
        "-r", str(req),
    ]  # fmt: skip
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        shutil.rmtree(partial, ignore_errors=True)
        raise PackagesError("pip did not finish installing the requirements in time") from None
    if run.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        err = (run.stderr or run.stdout).strip()
        raise PackagesError(f"pip could not install the requirements: {err[-MAX_ERROR_CHARS:]}")
    (partial / COMPLETE).write_text(requirements)
    _read_only(partial)
    partial.rename(dest)


def _read_only(top: Path) -> None:
    """Everything under ``top`` readable by all, writable by none."""
    for folder, _dirs, files in os.walk(top):
        for name in files:
            p = os.path.join(folder, name)
            if not os.path.islink(p):
                os.chmod(p, (os.stat(p).st_mode | 0o444) & ~0o222)
        os.chmod(folder, 0o555)
