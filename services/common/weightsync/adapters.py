"""LoRA adapters as weight pushes carry them: PEFT's tensor names and shapes, checked before any
byte is loaded, and the folder an adapter is written to (what vLLM's LoRA API and PEFT read).

A push of an adapter (``UpdateWeightsRequest.lora``) carries only the ``lora_A`` / ``lora_B``
tensors, under the names PEFT saves them with (``adapter_model.safetensors``), so the folder a
replica writes from them is exactly the folder ``ExportModel`` writes: loading either gives the
same adapter. Shared by the learner (what it sends and exports) and the generator (what it
takes), so neither knows the other.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.common.weightsync.plan import TensorMeta

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MAX_TARGETS = 64
MAX_ADAPTER_TENSORS = 100_000
_NAME = re.compile(r"base_model\.model\.((?:[A-Za-z0-9_]+\.)*([A-Za-z0-9_]+))\.lora_([AB])\.weight")
_FLOAT = {"float32", "bfloat16", "float16"}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter's shape (PEFT's LoraConfig, the proto's ``LoraAdapter``)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = field(default_factory=tuple)

    def problem(self) -> str:
        """Why this is no adapter a replica can take, or "".

        >>> AdapterSpec(16, 32.0, ("q_proj",)).problem(), AdapterSpec(0, 1.0, ("q",)).problem()
        ('', 'lora.rank must be 1 to 512')
        """
        if not 1 <= self.rank <= 512:
            return "lora.rank must be 1 to 512"
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            return "lora.alpha must be finite and positive"
        if not 1 <= len(self.target_modules) <= MAX_TARGETS:
            return f"lora.target_modules must name 1 to {MAX_TARGETS} modules"
        if any(not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", t) for t in self.target_modules):
            return "lora.target_modules: each is 1 to 128 letters, digits, '_', '-' or '.'"
        return ""

    def config_json(self, base_model: str = "") -> str:
        """The ``adapter_config.json`` PEFT writes for this adapter (what vLLM and PEFT read)."""
        return json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base_model,
                "r": self.rank,
                "lora_alpha": self.alpha,
                "lora_dropout": 0.0,
                "target_modules": sorted(self.target_modules),
                "bias": "none",
                "fan_in_fan_out": False,
                "inference_mode": True,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            },
            indent=2,
        )


def adapter_problems(spec: AdapterSpec, metas: list[TensorMeta]) -> list[str]:
    """What keeps ``metas`` from being ``spec``'s adapter tensors (empty: nothing): PEFT's names
    of a target module, lora_A [rank, in] and lora_B [out, rank] in pairs, float dtypes.

    >>> A = TensorMeta("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "float32", (8, 64))
    >>> B = TensorMeta("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", "float32", (64, 8))
    >>> adapter_problems(AdapterSpec(8, 16.0, ("q_proj",)), [A, B])
    []
    >>> adapter_problems(AdapterSpec(8, 16.0, ("v_proj",)), [A])  # doctest: +NORMALIZE_WHITESPACE
    ['base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: q_proj is not a target module',
     'model.layers.0.self_attn.q_proj: lora_A without lora_B']
    """
    if len(metas) > MAX_ADAPTER_TENSORS:
        return [f"{len(metas)} tensors: an adapter has at most {MAX_ADAPTER_TENSORS}"]
    out, halves = [], {}
    for m in metas:
        got = _NAME.fullmatch(m.name)
        if got is None:
            out.append(f"{m.name[:200]}: not a LoRA tensor name (base_model.model.<module>.lora_A|B.weight)")
            continue
        module, leaf, half = got.groups()
        if leaf not in spec.target_modules:
            out.append(f"{m.name}: {leaf} is not a target module")
        if m.dtype not in _FLOAT:
            out.append(f"{m.name}: dtype {m.dtype}, not a float")
        if len(m.shape) != 2 or (m.shape[0] if half == "A" else m.shape[1]) != spec.rank:
            want = "[rank, in]" if half == "A" else "[out, rank]"
            out.append(f"{m.name}: shape {list(m.shape)}, not {want} with rank {spec.rank}")
        if (module, half) in halves:
            out.append(f"{m.name}: sent twice")
        halves[(module, half)] = m
    for module, half in sorted(halves):
        other = "B" if half == "A" else "A"
        if (module, other) not in halves:
            out.append(f"{module}: lora_{half} without lora_{other}")
    return out


def write_adapter(folder: str | Path, spec: AdapterSpec, tensors: dict, base_model: str = "") -> Path:
    """Write an adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), whole
    or not at all: it is written beside ``folder`` and renamed into place."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / ADAPTER_CONFIG).write_text(spec.config_json(base_model))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"}
    )
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder
