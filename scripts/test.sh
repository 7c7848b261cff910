#!/usr/bin/env bash
# The test command: install (idempotent) and run the whole suite, lint included.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/install.sh >/dev/null
# shellcheck disable=SC1091
. .venv/bin/activate
export VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1
ruff check .
ruff format --check .
python scripts/gen_protos.py --check
python -m pytest "$@"
