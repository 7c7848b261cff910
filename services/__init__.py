"""relayrl: RL post-training of LLMs as decoupled gRPC services.

Importing this package is cheap on purpose: contracts (``relayrl.<svc>.v1``) and configs load
without torch, vLLM or DeepSpeed, so ``relayrl --help`` and the reward image stay light.
"""

from relayrl._compat import hide_mismatched_torch_addons

__version__ = "0.1.0"

hide_mismatched_torch_addons()
