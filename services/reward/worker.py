"""The scoring worker process (the other side of ``pool.py``): it loads the built-in scorers and the
plugins, reports what it serves (or why a plugin failed), then scores one sample at a time from
its pipe until told to stop. Samples and results are JSON both ways. It dies with its server."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from relayrl.reward.scorers import SCORERS, Scorer, check_result, decode_ground_truth

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
MAX_ERROR_CHARS = 2000
"""Error messages from scorers are cut to this length."""


class PluginError(RuntimeError):
    """A plugin could not be loaded (import failed, not callable, no ``data_sources``)."""


@dataclass(frozen=True)
class ScorerInfo:
    data_source: str
    from_plugin: bool
    origin: str
    """``module:function`` of the scorer."""


def load_plugin(ref: str) -> tuple[Scorer, list[str]]:
    """Import ``module:function``; the function's ``data_sources`` attribute names what it scores."""
    module, _, name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raises on import
        raise PluginError(f"plugin {ref}: cannot load: {type(e).__name__}: {e}") from e
    sources = getattr(fn, "data_sources", None)
    if not callable(fn):
        raise PluginError(f"plugin {ref}: not callable")
    if isinstance(sources, str) or not isinstance(sources, list | tuple) or not sources:
        raise PluginError(f"plugin {ref}: needs a data_sources attribute, a non-empty list of names")
    if not all(isinstance(s, str) and s for s in sources):
        raise PluginError(f"plugin {ref}: data_sources must hold non-empty strings, got {sources!r}")
    return fn, list(sources)


def build_registry(plugins: Sequence[str]) -> tuple[dict[str, Scorer], list[ScorerInfo]]:
    """Built-in scorers, then plugins (a plugin may replace a built-in, not another plugin)."""
    registry: dict[str, Scorer] = dict(SCORERS)
    infos = {s: ScorerInfo(s, False, f"{fn.__module__}:{fn.__qualname__}") for s, fn in SCORERS.items()}
    for ref in plugins:
        fn, sources = load_plugin(ref)
        for source in sources:
            prev = infos.get(source)
            if prev is not None and prev.from_plugin:
                raise PluginError(f"plugin {ref}: data source {source!r} is already served by {prev.origin}")
            registry[source] = fn
            infos[source] = ScorerInfo(source, True, ref)
    return registry, sorted(infos.values(), key=lambda i: i.data_source)


def score_one(registry: dict[str, Scorer], task: list) -> list:
    """Score one decoded task; never raises. Returns ``[status, reward, components, error]``."""
    data_source, completion, ground_truth, extra_info, prompt = task
    try:
        if prompt and "prompt" not in extra_info:
            extra_info = {**extra_info, "prompt": prompt}
        result = check_result(
            registry[data_source](completion, decode_ground_truth(ground_truth), extra_info)
        )
        return [OK, result.reward, result.components, ""]
    except Exception as e:
        return [ERROR, 0.0, {}, f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]]


def _die_with(parent_pid: int) -> None:
    """SIGKILL this process when the server (which started it from its main thread) exits."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the server died before prctl took effect
        os._exit(1)


def worker_main(conn, plugins: list[str], parent_pid: int, sandbox_json: str = "") -> None:
    """Worker process: report the scorers (or why plugins failed, or why its sandbox did not
    start), then score until told to stop."""
    _die_with(parent_pid)
    # Signals to the process group are the server's business: it stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.getcwd() not in sys.path:  # plugins next to where `relayrl serve` was started
        sys.path.append(os.getcwd())
    try:
        registry, infos = build_registry(plugins)
        if sandbox_json:  # code rewards: the probe (seconds) before ready, not in a sample's time
            from relayrl.common.sandbox import SandboxConfig
            from relayrl.reward.code import start_sandbox

            start_sandbox(SandboxConfig.model_validate_json(sandbox_json))
    except Exception as e:
        conn.send_bytes(json.dumps({"fatal": str(e)}).encode())
        return
    try:
        import math_verify  # noqa: F401  (sympy: ~0.5 s, paid before "ready", not by the first MATH sample)
    except ImportError:
        pass
    conn.send_bytes(
        json.dumps({"scorers": [[i.data_source, i.from_plugin, i.origin] for i in infos]}).encode()
    )
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):  # the server is gone
            return
        task = json.loads(raw)
        if task is None:
            return
        conn.send_bytes(json.dumps(score_one(registry, task)).encode())
