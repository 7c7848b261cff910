"""Run under torchrun by test_learner_service: the two-rank ZeRO-3 checks in one process group,
one start of two ranks instead of three (each check's module also runs alone under torchrun).
Each check prints its own line; the first that fails ends the run with its traceback."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import device_check
import nonfinite_check
import partition_check
import torch.distributed as dist
from relayrl.learner.rank import init_distributed

init_distributed()
partition_check.check(sys.argv[1])
nonfinite_check.check(sys.argv[1])
device_check.run(sys.argv[1])
dist.destroy_process_group()
