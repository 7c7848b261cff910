"""What a sandboxed job may be given beyond its code, stdin and /tmp files, checked: host paths
bound into it read-only (``binds``: a Unix socket through which a harness env's agent reaches the
gateway) and environment variables (``env``: the agent's OPENAI_BASE_URL and key). Both are for
the env service's harness envs; a job given neither runs exactly as before.

The full tier sets ``env`` through a descriptor bwrap reads its arguments from (``env_args``), not
its command line, so a secret never shows in the host's process list.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_RESERVED_ENV = ("PATH", "HOME")
"""Set by the sandbox itself (the interpreter's lookup, the job's home in its /tmp)."""
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/proc", "/dev", "/tmp")
"""The sandbox's own tree: a bind may not hide or land in it."""
MAX_BINDS = 8
MAX_ENV = 32
MAX_ENV_VALUE_CHARS = 4096
MAX_PATH_CHARS = 1024


def check_binds(binds: Mapping[str, str] | None) -> dict[str, str]:
    """``binds`` (host path -> path inside the job) when each host path is absolute and exists, and
    each inside path is absolute, normalised and outside the sandbox's own tree (/usr, /tmp, ...).

    >>> check_binds({"/tmp": "/run/relayrl"})
    {'/tmp': '/run/relayrl'}
    >>> check_binds({"/tmp": "/usr/x"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: sandbox bind target must be an absolute, normalised path outside / /usr ..., got '/usr/x'
    """
    out = dict(binds or {})
    if len(out) > MAX_BINDS:
        raise ValueError(f"at most {MAX_BINDS} sandbox binds, got {len(out)}")
    for host, inside in out.items():
        if not isinstance(host, str) or not os.path.isabs(host) or len(host) > MAX_PATH_CHARS:
            raise ValueError(f"sandbox bind source must be an absolute host path, got {host!r:.80}")
        if not os.path.exists(host):
            raise ValueError(f"sandbox bind source {host!r:.80} does not exist")
        if (
            not isinstance(inside, str)
            or len(inside) > MAX_PATH_CHARS
            or not inside.startswith("/")
            or os.path.normpath(inside) != inside
            or inside == "/"
            or any(inside == d or inside.startswith(d + "/") for d in _SYSTEM_DIRS)
        ):
            raise ValueError(
                "sandbox bind target must be an absolute, normalised path outside / "
                f"{' '.join(_SYSTEM_DIRS)}, got {inside!r:.80}"
            )
    return out


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env`` when every name is a shell-style variable name other than PATH and HOME (the
    sandbox sets those) and every value is text without NUL, bounded.

    >>> check_env({"OPENAI_MODEL": "tiny"})
    {'OPENAI_MODEL': 'tiny'}
    """
    out = dict(env or {})
    if len(out) > MAX_ENV:
        raise ValueError(f"at most {MAX_ENV} sandbox environment variables, got {len(out)}")
    for name, value in out.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name) or name in _RESERVED_ENV:
            raise ValueError(
                "sandbox environment variable name must be a plain name other than PATH and HOME, "
                f"got {name!r:.80}"
            )
        if not isinstance(value, str) or "\0" in value or len(value) > MAX_ENV_VALUE_CHARS:
            raise ValueError(
                f"sandbox environment variable {name}: value must be text without NUL, at most "
                f"{MAX_ENV_VALUE_CHARS} characters"
            )
    return out


def env_args(env: Mapping[str, str]) -> bytes:
    """bwrap's ``--args`` text that sets ``env`` (NUL-separated ``--setenv NAME VALUE``).

    >>> env_args({"A": "1"})
    b'--setenv\\x00A\\x001\\x00'
    """
    return b"".join(b"%s\0%s\0%s\0" % (b"--setenv", k.encode(), v.encode()) for k, v in env.items())
