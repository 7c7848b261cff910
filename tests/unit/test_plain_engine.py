"""The plain engine on its own (no process group, no DeepSpeed): float32 master weights beside a
bfloat16 module, gradients accumulated in float32 across micro-batches, the clip as torch's, a
non-finite step that changes nothing, checkpoints that round-trip exactly, and the step's cost
counted the way it shows on a GPU: operators dispatched (the same for 4 parameters as for 64:
foreach and fused kernels, no per-parameter Python) and no hook on any parameter."""

from __future__ import annotations

import torch
from relayrl.learner.config import LearnerConfig, OptimConfig
from relayrl.learner.engines import PlainEngine
from torch.utils._python_dispatch import TorchDispatchMode

CPU = torch.device("cpu")


def _model(n_layers: int = 2, width: int = 8, dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(n_layers))).to(dtype)


def _engine(module, dtype=torch.float32, lr=1e-2, clip=1.0) -> PlainEngine:
    cfg = LearnerConfig(optim=OptimConfig(lr=lr, grad_clip=clip))
    return PlainEngine(module, cfg, CPU, dtype, frozen=False)


def _loss(engine: PlainEngine, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return engine(x.to(next(engine.module.parameters()).dtype)).float().pow(2).mean() * scale


def test_bfloat16_modules_train_on_float32_master_weights():
    """An update far below bfloat16's resolution (lr 1e-6 on weights near 0.3) would vanish in
    the module's own dtype; the masters keep it, and the module is always their rounding."""
    e = _engine(_model(dtype=torch.bfloat16), torch.bfloat16, lr=1e-6)
    start = [m.detach().clone() for m in e.master]
    x = torch.randn(4, 8)
    for _ in range(3):
        e.backward(_loss(e, x))
        applied, norm = e.step()
        assert applied and norm > 0
    assert all(not torch.equal(a, b) for a, b in zip(start, e.master, strict=True))
    for p, m in zip(e.params, e.master, strict=True):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))


def test_micro_batches_accumulate_as_one_batch_in_float32():
    x = torch.randn(6, 8)
    one = _engine(_model())
    one.backward(_loss(one, x))
    two = _engine(_model())
    for part in (x[:3], x[3:]):
        two.backward(_loss(two, part, 0.5))
    for a, b in zip(one.params, two.params, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    na, nb = one.step()[1], two.step()[1]
    assert abs(na - nb) <= 1e-6 * na
    halves = _engine(_model(dtype=torch.bfloat16), torch.bfloat16)
    for part in (x[:3], x[3:]):
        halves.backward(_loss(halves, part, 0.5))
    assert all(g.dtype == torch.float32 for g in halves._acc) and all(p.grad is None for p in halves.params)


def test_the_clip_is_torchs():
    x = torch.randn(4, 8) * 50
    e, ref = _engine(_model(), clip=0.1), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    e.backward(_loss(e, x))
    ref(x).pow(2).mean().backward()
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt.step()
    applied, norm = e.step()
    assert applied and abs(norm - float(total)) <= 1e-6 * float(total)
    for a, b in zip(e.params, ref.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_a_non_finite_step_changes_nothing():
    e = _engine(_model(dtype=torch.bfloat16), torch.bfloat16)
    e.backward(_loss(e, torch.randn(4, 8)))
    e.step()
    before = [
        t.clone()
        for t in [*e.params, *e.master, *(v for s in e.optimizer.state.values() for v in s.values())]
    ]
    lr = e.lr()
    e.backward(_loss(e, torch.full((4, 8), float("inf"))))
    applied, norm = e.step()
    assert not applied and not torch.isfinite(torch.tensor(norm))
    after = [*e.params, *e.master, *(v for s in e.optimizer.state.values() for v in s.values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)) and e.lr() == lr
    assert e._acc is None and all(p.grad is None for p in e.params)


def test_checkpoints_round_trip_exactly(tmp_path):
    x = torch.randn(4, 8)
    for dtype in (torch.float32, torch.bfloat16):
        a = _engine(_model(dtype=dtype), dtype)
        a.backward(_loss(a, x))
        a.step()
        a.save(str(tmp_path / str(dtype)), "t1", {"mine": 1}, exclude_frozen=False)
        b = _engine(_model(dtype=dtype, seed=1), dtype)
        assert b.load(str(tmp_path / str(dtype)), None, strict=True) == {"mine": 1}
        for e in (a, b):
            e.backward(_loss(e, x))
            e.step()
        for p, q in zip(a.params, b.params, strict=True):
            assert torch.equal(p, q)
    assert _engine(_model()).load(str(tmp_path / "nothing"), None, strict=True) is None


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step_ops(n_layers: int, dtype: torch.dtype) -> int:
    e = _engine(_model(n_layers, dtype=dtype), dtype)
    x = torch.randn(4, 8)
    for _ in range(2):  # the second step: the optimizer's state exists
        e.backward(_loss(e, x))
        with _Count() as count:
            e.step()
    return count.ops


def test_a_step_dispatches_as_many_operators_for_64_parameters_as_for_4_and_hooks_nothing():
    for dtype in (torch.float32, torch.bfloat16):
        assert _step_ops(2, dtype) == _step_ops(32, dtype), dtype
    e = _engine(_model(32))
    assert all(
        not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None) for p in e.params
    )
