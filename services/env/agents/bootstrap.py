"""The main program of a harness env's sandbox job: the gateway's forwarder, then the agent.

Copied into the sandbox's /tmp as main.py (with ``relay.py``, the agent as ``agent.py`` and its
files beside it) and run by Debian's ``python3 -I -S -B``: standard library only, nothing of
relayrl. The job's network namespace has nothing but its own loopback; when
``RELAYRL_GATEWAY_SOCKET`` names the Unix socket the harness bind-mounted in, a thread serves TCP
127.0.0.1:8000 there and pipes each connection to that socket (``relay.Relay``), whose other end on
the host pipes it on to the gateway (``relayrl.env.forward``). So ``OPENAI_BASE_URL``
(http://127.0.0.1:8000/...) is the agent's only network. Without it (tier ``rlimits-only``, no
namespaces) nothing is served and the agent's ``OPENAI_BASE_URL`` is the gateway itself.

Then the agent runs in this process (``runpy``, as ``__main__``, its folder first on
``sys.path``: ``-I`` leaves the script's folder out; then its installed requirements, where the
harness mounted them), with this process's stdin, stdout and stderr; the job exits with the
agent's status (1 for an exception it raised).
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import traceback

LISTEN = ("127.0.0.1", 8000)
"""Where the agent reaches the gateway, inside the job's own network namespace."""
MAX_CONNECTIONS = 16
"""Connections to the gateway open at once (more are closed at once; the agent may retry)."""
HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "agent.py")


def forward(path: str):
    """Serve ``LISTEN``, piping each connection to the Unix socket at ``path``; the relay."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from relay import Relay  # the copy beside this file

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(LISTEN)
    listener.listen(MAX_CONNECTIONS)
    return Relay(listener, (socket.AF_UNIX, path), MAX_CONNECTIONS).start()


def run_agent(path: str = AGENT) -> int:
    """Run the agent program as ``__main__``; its exit status. Its installed requirements
    (``RELAYRL_AGENT_PACKAGES``, mounted read-only) go on ``sys.path`` after its own folder, their
    ``.pth`` files read as site-packages' are (``-S`` skipped that)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    packages = os.environ.get("RELAYRL_AGENT_PACKAGES", "")
    if packages:
        import site

        site.addsitedir(packages)
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)  # sys.exit("message"): the message, status 1
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> int:
    path = os.environ.get("RELAYRL_GATEWAY_SOCKET", "")
    relay = forward(path) if path else None
    try:
        return run_agent()
    finally:
        sys.stdout.flush()
        if relay is not None:
            relay.close()


if __name__ == "__main__":
    sys.exit(main())
