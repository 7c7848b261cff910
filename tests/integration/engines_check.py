"""Run under torchrun (one rank) by test_learner_engines: the one-rank plain engine against
DeepSpeed ZeRO-2, the engine every one-rank learner ran before it (float32, CPU).

1. Three steps of each on the same batches: losses, gradient norms and every gradient equal to
   rel < 1e-5, and the weights after every step to rel < 1e-6 as a whole. Each tensor is held
   to 1e-3 only: Adam's first steps divide each element by its own magnitude, so an element
   whose gradient is within a few ulps of Adam's eps (some of the key projections' biases here)
   moves by an amount its last bits decide, and two correct sums in another order differ there.
2. A ZeRO-2 checkpoint (the format those learners wrote) loads into the plain engine, and the
   steps after it equal ZeRO-2's own steps after its own load, to rel < 1e-5.
3. The plain engine's own checkpoint resumes bit for bit: two steps straight equal save, a new
   trainer, load, two steps.
4. A step whose gradient norm is not finite changes nothing (weights, optimizer, schedule).

    torchrun --nproc_per_node 1 engines_check.py MODEL_DIR TMP_DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.kit, when torchrun runs this file

import relayrl  # noqa: F401
import torch
import torch.distributed as dist
from relayrl.learner.config import LearnerConfig, OptimConfig
from relayrl.learner.engines import DeepSpeedEngine, PlainEngine
from relayrl.learner.rank import init_distributed
from relayrl.learner.samples import Sample, decode_samples
from relayrl.learner.trainer import Trainer
from relayrl.learner.v1 import learner_pb2 as lp

from tests.kit.learner import batch

MODEL, TMP = sys.argv[1], Path(sys.argv[2])
init_distributed()


def trainer(stage: int | None) -> Trainer:
    cfg = LearnerConfig(model=MODEL, zero_stage=stage, micro_batch_tokens=48, optim=OptimConfig(lr=1e-3))
    return Trainer(cfg)


def batches(seeds) -> list[list[Sample]]:
    t = plain
    return [
        decode_samples(lp.TrainStepRequest(samples=batch(s, n=8)), t.vocab_size, t.max_len, t.cfg)
        for s in seeds
    ]


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().float() for n, p in t.engine.module.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def same(a: dict, b: dict, tol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    diffs = sorted(((rel(a[k], b[k]), k) for k in a), reverse=True)
    assert diffs[0][0] < tol, f"{what}: " + ", ".join(f"{k} {d:.2e}" for d, k in diffs[:6])


def steps(t: Trainer, bs) -> list[dict]:
    return [t.train_step(b, max(len(s.completion) for s in b)) for b in bs]


def capture(t: Trainer, full_grad) -> list[dict]:
    """Record every gradient just before each optimizer step (after the last micro-batch)."""
    seen, step_once = [], t.engine.step

    def step():
        seen.append({n: full_grad(p).detach().clone().float() for n, p in t.engine.module.named_parameters()})
        return step_once()

    t.engine.step = step
    return seen


def flat(d: dict) -> torch.Tensor:
    return torch.cat([d[k].reshape(-1) for k in sorted(d)])


plain = trainer(None)
assert isinstance(plain.engine, PlainEngine) and plain.engine.stage == 0
zero2 = trainer(2)
assert isinstance(zero2.engine, DeepSpeedEngine) and zero2.engine.stage == 2
same(weights(plain), weights(zero2), 1e-12, "the start")
from deepspeed.utils import safe_get_full_grad  # noqa: E402

grads_p, grads_z = capture(plain, lambda p: p.grad), capture(zero2, safe_get_full_grad)
bs = batches([21, 22, 23])
for k, b in enumerate(bs, 1):
    mp, mz = steps(plain, [b])[0], steps(zero2, [b])[0]
    assert mp["applied"] and mz["applied"], (mp, mz)
    assert abs(mp["loss"] - mz["loss"]) <= 1e-5 * abs(mz["loss"]), (k, mp["loss"], mz["loss"])
    assert abs(mp["grad_norm"] - mz["grad_norm"]) <= 1e-5 * mz["grad_norm"], (
        k,
        mp["grad_norm"],
        mz["grad_norm"],
    )
    same(grads_p[-1], grads_z[-1], 1e-5, f"gradients of step {k}")
    wp, wz = weights(plain), weights(zero2)
    same(wp, wz, 1e-3, f"weights after step {k}")
    assert rel(flat(wp), flat(wz)) < 1e-6, f"all weights after step {k}: {rel(flat(wp), flat(wz)):.2e}"
del plain.engine.step, zero2.engine.step  # the capturing wrappers
print("plain steps equal ZeRO-2's", flush=True)

# 2. ZeRO-2's checkpoint into a new plain trainer: the same steps after it.
zero2.save(str(TMP / "z2"), "s3", '{"pos": 3}')
at_save = weights(zero2)
later = batches([24, 25])
after_zero2 = steps(zero2, later)
fresh = trainer(None)
meta = fresh.load(str(TMP / "z2"), "s3")
same(weights(fresh), at_save, 1e-300, "ZeRO-2's weights as loaded")
assert (meta["step"], meta["policy_version"], meta["client_state_json"]) == (3, 3, '{"pos": 3}'), meta
assert fresh.engine.scheduler.last_epoch == 3
after_plain = steps(fresh, later)
for a, b in zip(after_plain, after_zero2, strict=True):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
wf, wz = weights(fresh), weights(zero2)
same(wf, wz, 1e-3, "after resuming ZeRO-2's checkpoint")
assert rel(flat(wf), flat(wz)) < 1e-6, "after resuming ZeRO-2's checkpoint"
print("a ZeRO-2 checkpoint resumes in the plain engine", flush=True)

# 3. The plain engine's own checkpoint: bit for bit.
plain.save(str(TMP / "plain"), "s3", '{"pos": 3}')
straight = steps(plain, later)
again = trainer(None)
again.load(str(TMP / "plain"), None)  # "latest"
resumed = steps(again, later)
assert [m["loss"] for m in straight] == [m["loss"] for m in resumed]
same(weights(again), weights(plain), 1e-300, "after resuming its own checkpoint")
print("the plain engine resumes identically", flush=True)


# 4. A non-finite step changes nothing.
def trained_state(t: Trainer) -> dict[str, torch.Tensor]:
    """The weights and the optimizer's moments."""
    moments = (
        v for st in t.engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()
    )
    return {**weights(t), **{f"opt{i}": v.clone() for i, v in enumerate(moments)}}


state = trained_state(again)
lr = again.engine.lr()
bad = [Sample(s.prompt, s.completion, s.behavior_logprobs, float("inf"), []) for s in later[0]]
m = again.train_step(bad, 12)
assert not m["applied"] and (again.step, again.version) == (5, 5), m
after = trained_state(again)
same(after, state, 1e-300, "a skipped step")
assert again.engine.lr() == lr and all(p.grad is None for p in again.engine.params)
print("a non-finite step changes nothing", flush=True)

# 5. Unset, the micro-batch budget is derived (on CPU the fixed default) and reported each step.
derived = Trainer(LearnerConfig(model=MODEL))
assert derived.micro_batch_tokens == 4096, derived.micro_batch_tokens
assert derived.train_step(later[0], 12)["micro_batch_tokens"] == 4096
print("the micro-batch budget is derived and reported", flush=True)
dist.destroy_process_group()
