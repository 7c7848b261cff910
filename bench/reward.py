"""Reward throughput of one replica: countdown and MATH batches through the real gRPC service.

    python bench/reward.py [--workers 2] [--countdown 256] [--math 128] [--repeats 5]

Workload. countdown: ``--countdown`` generated problems, each with its reference completion and
three wrong ones (a wrong operator, a number reused, no answer tags), so a quarter of the batch is
correct. MATH-style: ``--math`` fraction problems, each with a boxed answer in another form
(``\\frac{2a}{2b}``, a decimal where exact) and a wrong one, checked by math-verify. Each batch is
one ``Score`` call to ``relayrl serve reward --workers K`` in its own process; one warm-up call,
then the median of ``--repeats`` timed calls. Last line: ``reward_samples_per_s: X``, the countdown
figure (the common RL task; MATH is bounded by sympy, see its own row).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table


def countdown_batch(n: int):
    from relayrl.common.data.tasks import generate, reference_completion
    from relayrl.reward.v1 import reward_pb2 as r

    items = []
    for i, row in enumerate(generate("countdown", n, seed=0)):
        gt = row["reward_model"]["ground_truth"]
        right = reference_completion(row)
        expr = row["extra_info"]["expression"]
        wrong_op = right.replace(
            expr, expr.replace("+", "-", 1) if "+" in expr else expr.replace("*", "+", 1)
        )
        reused = right.replace(expr, f"{expr} + {gt['numbers'][0]} - {gt['numbers'][0]}")
        untagged = right.replace("<answer>", "").replace("</answer>", "")
        for j, completion in enumerate((right, wrong_op, reused, untagged)):
            items.append(r.RewardInput(sample_id=f"c{i}/{j}", data_source="countdown", completion=completion,
                                       ground_truth=json.dumps(gt)))  # fmt: skip
    return items


def math_batch(n: int):
    from relayrl.reward.v1 import reward_pb2 as r

    rng = random.Random(0)
    items = []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.choice([2, 4, 5, 8, 10, 3, 7])
        truth = rf"\frac{{{a}}}{{{b}}}"
        other = f"{a / b:g}" if b in (2, 4, 5, 8, 10) else rf"\frac{{{2 * a}}}{{{2 * b}}}"
        for j, answer in enumerate((other, rf"\frac{{{a + 1}}}{{{b}}}")):
            completion = f"<think>We simplify step by step.</think> The answer is $\\boxed{{{answer}}}$."
            items.append(r.RewardInput(sample_id=f"m{i}/{j}", data_source="math", completion=completion,
                                       ground_truth=truth))  # fmt: skip
    return items


def measure(stub, items, repeats: int) -> tuple[list[float], dict[str, float]]:
    from relayrl.reward.v1 import reward_pb2 as r

    request = r.ScoreRequest(items=items, timeout_seconds=30)
    rates = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        resp = stub.Score(request, timeout=600)
        if rep:  # the first call warms up
            rates.append(len(items) / (time.perf_counter() - t0))
    ok = [x for x in resp.results if x.status == r.SCORE_STATUS_OK]
    stats = {"ok": len(ok) / len(items), "correct": sum(x.components["correctness"] for x in ok) / len(items)}
    return rates, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--countdown", type=int, default=256, help="countdown problems (x4 samples)")
    ap.add_argument("--math", type=int, default=128, help="MATH-style problems (x2 samples)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import grpc
    from relayrl.reward.v1 import reward_pb2_grpc

    from tests.procs import service

    batches = {"countdown": countdown_batch(args.countdown), "math (math-verify)": math_batch(args.math)}
    rows, figures = [], {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        service(["reward", "--workers", str(args.workers)], Path(tmp), timeout=120) as (addr, _proc),
        grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 256 << 20)]) as channel,
    ):
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for name, items in batches.items():
            rates, stats = measure(stub, items, args.repeats)
            figures[name] = statistics.median(rates)
            rows.append([name, len(items), f"{figures[name]:.0f}", f"{min(rates):.0f}", f"{max(rates):.0f}",
                         f"{stats['ok']:.2f}", f"{stats['correct']:.2f}"])  # fmt: skip
    print_table(
        ["batch", "samples/call", "median samples/s", "min", "max", "status ok", "correct"],
        rows,
        title=f"reward throughput, one replica, --workers {args.workers}, {args.repeats} timed calls "
        "(reward_samples_per_s = the countdown median)",
    )
    print(f"reward_samples_per_s: {figures['countdown']:.0f}")


if __name__ == "__main__":
    main()
