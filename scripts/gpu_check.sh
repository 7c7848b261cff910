#!/usr/bin/env bash
# The GPU check, sized to what a lent GPU machine gives: one 10-minute call on one GPU. It runs,
# most important first, each part under its own `timeout` (one stuck part cannot eat the rest):
#   1. bench/learner.py at 0.5B (relayrl's TrainStep against plain PyTorch, save and load)
#   2. bench/sync_ipc.py (the staging check, then the CUDA IPC push against a device copy)
#   3. the gpu-marked test files, by name, one part each (GPU_TESTS below; `pytest -m gpu tests`
#      would collect every module, and those importing what such a machine lacks, cryptography,
#      openai, math-verify, vllm or ray, stop the collection before any test runs)
#   4. bench/learner.py at 1.5B, then packed against padded on the long-tailed 0.5B mix
#   5. the LoRA learner's equality with a plain PEFT step (a CPU test), when time remains
# A part runs only when the time left holds its expected time (measured on an H200, below), and
# stops at its limit or at the end of the budget. bench/results/gpu.md names the machine at the
# top and gets each part's result the moment it ends, so a call stopped at its time limit still
# leaves what finished. A short table comes last.
#
#   bash scripts/gpu_check.sh                       # a machine with network: installs what is missing
#   bash scripts/gpu_check.sh --wheels DIR          # offline: install from a folder of wheels/sdists
#   bash scripts/gpu_check.sh --budget 570          # seconds for everything (GPU_CHECK_BUDGET_S)
#   bash scripts/gpu_check.sh --plan                # print the parts, their times and commands; run nothing
#
# DIR holds what the machine lacks, made on a machine with network (see ../shared/NOTES.md, GPUs):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d DIR pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions hjson grpcio grpcio-health-checking grpcio-reflection \
#     protobuf safetensors psutil pyarrow pyyaml prometheus-client peft pytest-asyncio
#   pip download --no-deps --no-binary=:all: -d DIR deepspeed   # builds against the machine's torch
# The machine's own torch is used as it is (never replaced).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
python="${PYTHON:-python3}"
wheels=""
budget="${GPU_CHECK_BUDGET_S:-570}"
plan_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --plan) plan_only=1; shift ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done

# The gpu-marked test files, run by name in this order (tests/unit/test_gpu_check_script.py checks
# that each exists, carries the gpu marker and collects without the modules such machines lack).
GPU_TESTS=(
  tests/integration/test_weight_transports_gpu.py
  tests/unit/test_packing.py
  tests/integration/test_learner_gpu.py
)
# Expected seconds and limit, per part. Measured on an H200 (relayrl at bb01cc8): install, the
# benches. Estimated: the test files (~4 min together there, 120 s of it the transport test's
# stuck receiver, 65 s the critic/reference test) and the LoRA test.
declare -A EXPECT=(
  [install]=22 [learner-0.5b]=87 [sync-ipc]=25 [learner-1.5b]=149 [long-tailed-0.5b]=128
  [tests/integration/test_weight_transports_gpu.py]=20 [tests/unit/test_packing.py]=15
  [tests/integration/test_learner_gpu.py]=110 [lora-cpu]=60
)
declare -A LIMIT=(
  [install]=90 [learner-0.5b]=150 [sync-ipc]=90 [learner-1.5b]=220 [long-tailed-0.5b]=190
  [tests/integration/test_weight_transports_gpu.py]=150 [tests/unit/test_packing.py]=60
  [tests/integration/test_learner_gpu.py]=200 [lora-cpu]=150
)
out="bench/results/gpu.md"
logs="$(mktemp -d)"
rows=()

# part NAME CMD...: run CMD under its limit when the budget allows; append its result to $out
# (under the command, or $show when set).
part() {
  local name="$1"; shift
  local expect="${EXPECT[$name]}" limit="${LIMIT[$name]}"
  if [ "$plan_only" = 1 ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" "$expect" "$limit" "${show:-$*}"
    return 0
  fi
  local left=$((budget - SECONDS - 5)) status figure t0 rc log="$logs/${name//\//_}.log"
  if [ "$left" -lt "$expect" ]; then
    rows+=("$name|skipped: ${left}s left, ${expect}s expected|0|-")
    printf '\n## %s: skipped (%ss of the budget left, %ss expected)\n' "$name" "$left" "$expect" >> "$out"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "gpu_check: $name (limit ${limit}s): ${show:-$*}"
  t0=$SECONDS
  # SIGINT first: Python unwinds, and the benches stop the services they started (in sessions of
  # their own, out of timeout's reach); KILL 20 s later if that did not end it
  timeout -s INT --kill-after=20 "$limit" "$@" > "$log" 2>&1
  rc=$?
  case "$rc" in
    0) status="ok" ;;
    124 | 137) status="timed out at ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  # its figure: the last "name: number" line (benches), or pytest's summary line
  figure="$(grep -E '^[a-z_]+: [0-9.]+$' "$log" | tail -1)"
  [ -z "$figure" ] && figure="$(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
  rows+=("$name|$status|$((SECONDS - t0))|${figure:--}")
  {
    printf '\n## %s: %s (%ss)\n\n`%s`\n\n```\n' "$name" "$status" "$((SECONDS - t0))" "${show:-$*}"
    tail -n 40 "$log"
    printf '```\n'
  } >> "$out"
}

if [ "$plan_only" = 0 ]; then
  "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" \
    || { echo "gpu_check: needs a CUDA GPU and torch with CUDA" >&2; exit 2; }
  mkdir -p "$(dirname "$out")"
  machine="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  [ -z "$machine" ] && machine="$("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')"
  {
    echo "# GPU check ($(date -u +%Y-%m-%d), relayrl $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    echo "Machine: $machine; $(nproc) CPU cores; torch $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')."
    echo "Budget ${budget} s; parts are appended as they end (a part missing below did not end)."
  } > "$out"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" HF_HUB_OFFLINE=1
  # a 1.5B ZeRO checkpoint is ~24 GB: the benches write theirs to /dev/shm when it can hold them
  if [ -z "${TMPDIR:-}" ] && [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -gt $((40 << 20)) ] 2>/dev/null; then
    export TMPDIR=/dev/shm
  fi
fi

# offline (--wheels DIR): into a fresh --target, put first on PYTHONPATH for the parts after it
export GPU_CHECK_PY="$python" GPU_CHECK_WHEELS="$wheels" GPU_CHECK_SITE="$logs/site"
install='if [ -n "$GPU_CHECK_WHEELS" ]; then site="$(mktemp -d)" && "$GPU_CHECK_PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --target "$site" "$GPU_CHECK_WHEELS"/* ./ && echo "$site" > "$GPU_CHECK_SITE"; elif ! "$GPU_CHECK_PY" -c "import deepspeed, relayrl" 2>/dev/null; then "$GPU_CHECK_PY" -m pip install --quiet -e ".[learner,dev]"; fi'
shown="pip install -e .[learner,dev] if deepspeed or relayrl is missing"
[ -n "$wheels" ] && shown="pip install --no-index --no-deps --target SITE $wheels/* ./"
show="$shown" part install bash -c "$install"
if [ "$plan_only" = 0 ]; then
  if [ -s "$logs/site" ]; then
    export PYTHONPATH="$(cat "$logs/site")${PYTHONPATH:+:$PYTHONPATH}"
  fi
  echo "Versions: $("$python" -c 'import torch, deepspeed; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {".".join(map(str, torch.cuda.nccl.version()))}, deepspeed {deepspeed.__version__}")' 2>&1 | tail -1)" >> "$out"
fi

part learner-0.5b "$python" bench/learner.py --sizes 0.5b --skewed "" --steps 4
part sync-ipc "$python" bench/sync_ipc.py
for f in "${GPU_TESTS[@]}"; do
  part "$f" "$python" -m pytest -q -m gpu -p no:cacheprovider "$f"
done
part learner-1.5b "$python" bench/learner.py --sizes 1.5b --skewed "" --steps 4
part long-tailed-0.5b "$python" bench/learner.py --sizes "" --skewed 0.5b-skewed --steps 4
part lora-cpu "$python" -m pytest -q -p no:cacheprovider tests/integration/test_learner_lora.py

[ "$plan_only" = 1 ] && exit 0
{
  printf '\n## Summary (%ss of %ss)\n\n| part | result | s | figure |\n|---|---|---|---|\n' "$SECONDS" "$budget"
  for r in "${rows[@]}"; do printf '| %s |\n' "${r//|/ | }"; done
} >> "$out"
echo
printf '%-48s %-36s %5s  %s\n' part result s figure
for r in "${rows[@]}"; do
  IFS='|' read -r n st s fig <<< "$r"
  printf '%-48s %-36s %5s  %s\n' "$n" "$st" "$s" "$fig"
done
echo "wrote $out"
