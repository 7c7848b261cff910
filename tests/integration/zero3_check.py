"""Run under torchrun (2 ranks, CPU) by test_learner_service, one launch for two checks of
DeepSpeed ZeRO-3 as the trainer sets it up:

1. every parameter is really partitioned (no rank holds a whole one outside a gather);
2. a step whose gradient norm is not finite is skipped alike on every rank, and leaves weights,
   optimizer, schedule, step and version as they were. The service refuses the inputs that
   lead there (advantages beyond 1e6, bad masks); this drives the trainer directly with an
   infinite advantage (no request may carry one) to reach the guard behind them.
"""

import sys

import relayrl  # noqa: F401
import torch
import torch.distributed as dist
from relayrl.learner.config import LearnerConfig
from relayrl.learner.rank import init_distributed
from relayrl.learner.trainer import Sample, Trainer

init_distributed()
world = dist.get_world_size()
# Every parameter partitioned, however small (the default keeps small ones whole on each rank).
trainer = Trainer(LearnerConfig(model=sys.argv[1], world_size=world, param_persistence_threshold=0))

# 1. partitioned, before any step
for name, p in trainer.engine.module.named_parameters():
    assert p.numel() == 0, f"{name} is materialised outside a gather: {tuple(p.shape)}"
    full = p.ds_numel
    local = p.ds_tensor.numel()
    assert local == -(-full // world), f"{name}: rank holds {local} of {full} elements"
print(
    f"rank {dist.get_rank()}: all {sum(1 for _ in trainer.engine.module.parameters())} params partitioned",
    flush=True,
)


# 2. a non-finite gradient norm changes nothing
def local_state() -> torch.Tensor:
    """This rank's weight partitions and optimizer moments, flattened."""
    parts = [p.ds_tensor.detach().clone().float().reshape(-1) for p in trainer.engine.module.parameters()]
    for group in trainer.engine.optimizer.fp32_partitioned_groups_flat:
        st = trainer.engine.optimizer.optimizer.state.get(group, {})
        parts += [
            v.detach().clone().float().reshape(-1) for v in st.values() if torch.is_tensor(v) and v.dim()
        ]
    return torch.cat(parts)


def samples(advantage: float) -> list[Sample]:
    return [
        Sample([5, 6, 7], [8, 9, 10, 11], [-2.0] * 4, advantage * (1 if i % 2 else -1), []) for i in range(4)
    ]


first = trainer.train_step(samples(1.0), 4)  # a real step: the optimizer has moments now
assert first["applied"] and trainer.step == 1, first
before, lr_before = local_state(), trainer.engine.lr()
bad = trainer.train_step(samples(float("inf")), 4)
assert not bad["applied"] and not torch.isfinite(torch.tensor(bad["grad_norm"])), bad
assert (trainer.step, trainer.version) == (1, 1)
assert torch.equal(local_state(), before), "a skipped step changed weights or optimizer state"
assert trainer.engine.lr() == lr_before
good = trainer.train_step(samples(1.0), 4)
assert good["applied"] and trainer.step == 2 and not torch.equal(local_state(), before)
print(f"rank {dist.get_rank()}: non-finite step skipped, state unchanged", flush=True)
dist.barrier()
dist.destroy_process_group()
