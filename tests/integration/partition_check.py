"""Run under torchrun by test_learner_service: every parameter is really partitioned."""

import sys

import relayrl  # noqa: F401
import torch.distributed as dist
from relayrl.learner.config import LearnerConfig
from relayrl.learner.rank import init_distributed
from relayrl.learner.trainer import Trainer

init_distributed()
trainer = Trainer(
    LearnerConfig(model=sys.argv[1], world_size=dist.get_world_size(), param_persistence_threshold=0)
)
world = dist.get_world_size()
for name, p in trainer.engine.module.named_parameters():
    assert p.numel() == 0, f"{name} is materialised outside a gather: {tuple(p.shape)}"
    full = p.ds_numel
    local = p.ds_tensor.numel()
    assert local == -(-full // world), f"{name}: rank holds {local} of {full} elements"
print(
    f"rank {dist.get_rank()}: all {sum(1 for _ in trainer.engine.module.parameters())} params partitioned",
    flush=True,
)
dist.barrier()
dist.destroy_process_group()
