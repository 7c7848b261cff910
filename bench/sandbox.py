"""Code sandbox speed: how long one sandboxed Python run takes, and how many a pool of workers does.

    python bench/sandbox.py [--runs 60] [--workers 2] [--tier full]

Workload. ``spawn``: a trivial program (``print(6 * 7)``, what a calculator tool call runs) run
``--runs`` times one after another through ``Sandbox.run``: the latency of a whole job (bubblewrap
with every namespace, rlimits, Debian's python3 starting, the output read back, the job's
processes gone). ``throughput``: ``4 x --runs`` such jobs given at once to a pool of ``--workers``:
executions per second. ``rlimits-only`` rows: the same with no namespaces (the weaker tier), to
show what isolation costs. Verdicts are checked (every run must be OK with output 42).
Last line: ``sandbox_spawn_p50_ms: X`` (the full tier).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table

PROGRAM = "print(6 * 7)"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _one(sandbox) -> float:
    from relayrl.common.sandbox import Verdict

    t0 = time.perf_counter()
    r = await sandbox.run(PROGRAM)
    dt = time.perf_counter() - t0
    if r.verdict != Verdict.OK or r.stdout.strip() != "42":
        raise SystemExit(f"bench: a run gave {r.verdict} {r.stdout[:80]!r} {r.stderr[-300:]!r}")
    return dt


async def measure(tier: str, runs: int, workers: int) -> dict[str, float]:
    from relayrl.common.sandbox import Sandbox, SandboxConfig

    sandbox = Sandbox.from_config(SandboxConfig(tier=tier, workers=workers))
    try:
        for _ in range(3):  # warm-up: page cache, the first namespace set-up
            await _one(sandbox)
        lat = [await _one(sandbox) for _ in range(runs)]
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(sandbox) for _ in range(4 * runs)))
        wall = time.perf_counter() - t0
    finally:
        sandbox.close()
    return {
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * _pct(lat, 0.99),
        "per_s": 4 * runs / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=60, help="sequential runs for the latency (default 60)")
    ap.add_argument("--workers", type=int, default=2, help="pool size for the throughput (default 2)")
    ap.add_argument(
        "--tier", default="full", choices=("full", "rlimits-only"), help="the tier of the last line"
    )
    args = ap.parse_args()
    tiers = [args.tier] + [t for t in ("full", "rlimits-only") if t != args.tier]
    got = {t: asyncio.run(measure(t, args.runs, args.workers)) for t in tiers}
    rows = [
        [t, f"{g['p50_ms']:.1f}", f"{g['p99_ms']:.1f}", f"{g['per_s']:.1f}", args.workers]
        for t, g in got.items()
    ]
    print_table(
        ["tier", "spawn p50 ms", "spawn p99 ms", "executions/s", "workers"],
        rows,
        f"sandbox: {PROGRAM!r}, {args.runs} sequential runs, then {4 * args.runs} at once",
    )
    print(f"full_vs_rlimits_only_p50: {got['full']['p50_ms'] / got['rlimits-only']['p50_ms']:.2f}")
    print(f"sandbox_executions_per_s: {got[args.tier]['per_s']:.1f}")
    print(f"sandbox_spawn_p50_ms: {got[args.tier]['p50_ms']:.1f}")


if __name__ == "__main__":
    main()
