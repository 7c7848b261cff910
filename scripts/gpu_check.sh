#!/usr/bin/env bash
# The GPU check: run the `gpu` tests (packed attention on torch's varlen kernel among them), the
# LoRA learner's equality with a plain PEFT step, bench/sync_ipc.py and bench/learner.py (ZeRO
# stages, packed against padded on a long-tailed mix, and the defaults measured: gradient
# checkpointing, persistence threshold, overlap_comm, head calls) on a CUDA machine and write
# bench/results/gpu.md with the machine named.
#
#   bash scripts/gpu_check.sh                       # a machine with network: installs what is missing
#   bash scripts/gpu_check.sh --wheels DIR          # offline: install from a folder of wheels/sdists
#
# DIR holds what the machine lacks, made on a machine with network (see ../shared/NOTES.md, GPUs):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d DIR pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions hjson grpcio grpcio-health-checking grpcio-reflection \
#     protobuf safetensors psutil pyarrow pyyaml prometheus-client
#   pip download --no-deps --no-binary=:all: -d DIR deepspeed   # builds against the machine's torch
# The machine's own torch is used as it is (never replaced).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
python="${PYTHON:-python3}"
wheels=""
[ "${1:-}" = "--wheels" ] && wheels="$2"

"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" \
  || { echo "gpu_check: needs a CUDA GPU and torch with CUDA" >&2; exit 2; }
if [ -n "$wheels" ]; then
  site="$(mktemp -d)"
  "$python" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$site" "$wheels"/* ./
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif ! "$python" -c "import deepspeed, relayrl" 2>/dev/null; then
  "$python" -m pip install --quiet -e ".[learner,dev]"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1

out="bench/results/gpu.md"
machine="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
versions="$("$python" -c 'import torch, deepspeed; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {\".\".join(map(str, torch.cuda.nccl.version()))}, deepspeed {deepspeed.__version__}")')"
tests="$("$python" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -15 || true)"
lora="$("$python" -m pytest -q tests/integration/test_learner_lora.py -p no:cacheprovider 2>&1 | tail -5 || true)"
ipc="$("$python" bench/sync_ipc.py 2>&1 | tail -8)"
variants="ckpt:gradient_checkpointing=true;persist0:param_persistence_threshold=0;no-overlap:overlap_comm=false;head-per-mb:head_calls=per_micro_batch"
bench="$("$python" bench/learner.py --sizes "${SIZES:-0.5b,1.5b}" --stages "${STAGES:-3,2}" --steps 4 \
  --variants "${VARIANTS:-$variants}" --skewed "${SKEWED:-0.5b-skewed}" 2>&1 | tail -40)"
{
  echo "# GPU check ($(date -u +%Y-%m-%d))"
  echo
  echo "Machine: $machine; $versions."
  echo
  echo "## pytest -m gpu"
  echo '```'
  echo "$tests"
  echo '```'
  echo
  echo "## LoRA: tests/integration/test_learner_lora.py"
  echo '```'
  echo "$lora"
  echo '```'
  echo
  echo "## bench/sync_ipc.py"
  echo '```'
  echo "$ipc"
  echo '```'
  echo
  echo "## bench/learner.py"
  echo '```'
  echo "$bench"
  echo '```'
} > "$out"
echo "wrote $out"
