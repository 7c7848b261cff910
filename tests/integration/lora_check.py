"""Run under torchrun by test_learner_lora: two LoRA TrainSteps of the learner (the plain engine at
one rank, DeepSpeed ZeRO-3 at two; ``learner.lora``, packed micro-batches) equal two steps of a plain PEFT model with torch's AdamW on
the same batches, each step from the same adapter: the loss, the gradient of every adapter tensor
(taken just before the optimizer step) and its norm, at both steps, rel < 1e-5 in float32. The adapters after each step
are held to 1e-3 only: Adam's first steps divide each element by its own magnitude, so an element
whose gradient is a near-cancelling sum (near Adam's eps) moves by an amount its last bits decide.
The base weights stay exactly as the model folder holds them; a push sends the adapter alone.

    torchrun --nproc_per_node N lora_check.py MODEL_DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.kit, when torchrun runs this file

import relayrl  # noqa: F401
import torch
import torch.distributed as dist
from relayrl.common.weightsync.plan import plan_buckets
from relayrl.learner import lora
from relayrl.learner.attention import ATTENTION, register
from relayrl.learner.batching import plan_step
from relayrl.learner.config import LearnerConfig, LoraConfig, OptimConfig
from relayrl.learner.losses import LossInputs, Totals, policy_loss
from relayrl.learner.models import Policy
from relayrl.learner.rank import init_distributed
from relayrl.learner.samples import decode_samples, to_batch
from relayrl.learner.trainer import Trainer
from relayrl.learner.v1 import learner_pb2 as lp

from tests.kit.learner import batch

MODEL = sys.argv[1]
LORA = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
OPTIM = OptimConfig(lr=5e-3)


def gathered(trainer: Trainer, params: dict) -> dict | None:
    buckets = plan_buckets(trainer.param_metas("float32", params), 1 << 20)
    out = {}
    for b, ts in zip(buckets, trainer.gathered_buckets(buckets, params), strict=True):
        if ts is not None:
            out.update({m.name: t.detach().cpu().clone() for m, t in zip(b.tensors, ts, strict=True)})
    return out if dist.get_rank() == 0 else None


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


init_distributed()
cfg = LearnerConfig(
    model=MODEL, world_size=dist.get_world_size(), lora=LORA, optim=OPTIM, micro_batch_tokens=64
)
trainer = Trainer(cfg)
assert trainer.peft is not None and trainer.packed
assert set(trainer.pushed) == set(lora.adapter_params(trainer.lm)) and all(
    ".lora_" in n for n in trainer.pushed
)
trainable = [n for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
assert trainable and all(".lora_" in n for n in trainable), trainable
req = [lp.TrainStepRequest(samples=batch(seed, n=8)) for seed in (3, 4)]
batches = [decode_samples(r, trainer.vocab_size, trainer.max_len, cfg) for r in req]
from deepspeed.utils import safe_get_full_grad  # noqa: E402

grads: list[dict] = []
step_once = trainer.engine.step


def step_capturing():  # every rank: the gathers are collective
    grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in trainer.pushed.items()})
    return step_once()


trainer.engine.step = step_capturing
got, adapters = [], []
for b in batches:
    got.append(trainer.train_step(b, max(len(s.completion) for s in b)))
    adapters.append(gathered(trainer, trainer.pushed))
base = gathered(trainer, lora.base_params(trainer.lm))

if dist.get_rank() == 0:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # the plain model is whole: no ZeRO-3 partitioning at load

    # The base weights are untouched, to the bit.
    stored = load_file(f"{MODEL}/model.safetensors")
    for name, t in base.items():
        assert torch.equal(t, stored[name]), f"{name} changed"
    # The same two steps with PEFT and torch alone.
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    lora.wrap(model, LORA)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=OPTIM.lr, betas=OPTIM.betas, weight_decay=OPTIM.weight_decay)
    register()
    model.set_attn_implementation(ATTENTION)
    policy = Policy(model, 1 << 20)
    for k, (samples, step) in enumerate(zip(batches, got, strict=True)):
        if k:  # each step from the learner's own adapter: one step compared, not two compounded
            with torch.no_grad():
                for n, p in lora.adapter_params(model).items():
                    p.copy_(adapters[k - 1][n])
        # The learner's micro-batches, every rank's, one after the other: the same sums.
        lengths = [len(x.prompt) + len(x.completion) for x in samples]
        width = max(len(x.completion) for x in samples)
        totals = Totals(
            tokens=sum(len(x.completion) for x in samples), sequences=len(samples), max_tokens=width
        )
        loss = 0.0
        for mb in [mb for rank in plan_step(lengths, dist.get_world_size(), 64, True) for mb in rank if mb]:
            b = to_batch([samples[i] for i in mb], torch.device("cpu"), packed=True)
            logp, _ = policy(b.ids, b.targets, b.starts, b.width, 1.0, None, b.packing)
            part, _ = policy_loss(LossInputs(logp, b.behavior, b.adv, b.mask), cfg.loss, totals)
            part.backward()
            loss += float(part)
        worst_grad = max(rel(grads[k][n], p.grad) for n, p in lora.adapter_params(model).items())
        assert worst_grad < 1e-5, (k, worst_grad)
        norm = torch.nn.utils.clip_grad_norm_(params, OPTIM.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(step["loss"] - loss) <= 1e-5 * abs(loss) + 1e-7, (step["loss"], loss)
        assert abs(step["grad_norm"] - float(norm)) <= 1e-5 * float(norm), (step["grad_norm"], float(norm))
        plain = lora.adapter_params(model)
        assert set(plain) == set(adapters[k])
        worst = max(rel(adapters[k][n], plain[n].detach()) for n in plain)
        assert worst < 1e-3, (k, worst)
    print(f"lora steps equal plain PEFT (gradients rel {worst_grad:.1e}); base unchanged", flush=True)
dist.barrier()
dist.destroy_process_group()
