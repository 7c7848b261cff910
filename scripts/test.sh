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
# Two workers by default (RELAYRL_TEST_WORKERS; 0 runs in one process): a test file goes whole to
# one worker, so its module fixtures (a warm-started model, a running stack) are built once.
workers="${RELAYRL_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
  python -m pytest "$@"
else
  python -m pytest -n "$workers" --dist loadfile "$@"
fi
