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
# The docs site (mkdocs.yml), strict: a broken link or anchor fails; seconds. Built into a temporary
# folder; the config reference page comes from the schema just checked (scripts/docs_hooks.py).
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
python -m pytest "$@"
