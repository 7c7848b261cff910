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
# The tests' packages outside relayrl's environment, fetched once into the cache (the tests
# themselves reach nothing past loopback), in the background while the lint and docs checks run
# (downloads, mostly waiting on the network); pytest starts once they are in.
cache="${RELAYRL_TEST_CACHE:-$HOME/.cache/relayrl-tests}"
mkdir -p "$cache"
fetch_test_packages() {
  # What the sandbox tests run with packages of its own (the LangChain agent, examples/agents/
  # langchain_calc; verifiers environments, tests/kit/verifiers_envs) needs its wheels for the
  # sandbox's interpreter (Debian's python3; tests/unit/test_harness_packages.py).
  local sandbox_py agent_reqs wheels openenv_dir
  sandbox_py="$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null \
    || /usr/local/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
  for agent_reqs in examples/agents/langchain_calc/requirements.txt tests/kit/verifiers_envs/requirements.txt; do
    wheels="$cache/agent-wheels/py$sandbox_py-$(sha256sum "$agent_reqs" | cut -c1-12)"
    if [ -n "$sandbox_py" ] && [ ! -e "$wheels/.complete" ]; then
      python -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version "$sandbox_py" \
        -d "$wheels" -r "$agent_reqs" >>"$cache/fetch.log" 2>&1 && touch "$wheels/.complete" \
        || echo "the wheels of $agent_reqs could not be fetched ($cache/fetch.log): the tests that need them are skipped" >&2
    fi
  done
  # OpenEnv's MCP environments need openenv-core >= 0.2.3 (fastmcp 4, gradio), which relayrl's
  # services never import: the tests' MCP env server (tests/kit/openenv_mcp_calc.py) runs from a
  # folder of its own, under the base interpreter with -S.
  openenv_dir="$cache/openenv-core-0.3.0-py$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [ ! -e "$openenv_dir/.complete" ]; then
    # shellcheck source=scripts/uv_index.sh
    . scripts/uv_index.sh
    python -m uv pip install --quiet --python "$(python -c 'import sys; print(sys._base_executable)')" \
      --target "$openenv_dir" ${uv_index[@]+"${uv_index[@]}"} openenv-core==0.3.0 >>"$cache/fetch.log" 2>&1 \
      && touch "$openenv_dir/.complete" \
      || echo "openenv-core 0.3.0 could not be installed ($cache/fetch.log): the OpenEnv MCP tests are skipped" >&2
  fi
}
fetch_test_packages &
fetching=$!
site="$(mktemp -d)"
# A failed check or Ctrl-C ends the fetch too: a later run would otherwise install beside it.
# The script's exit status stays the one it ended with (pytest's): under `set -e` a command that
# fails inside the trap (kill of a fetch already waited for) would otherwise exit 1 after a green run.
end_fetch() {
  local rc=$?
  pkill -P "$fetching" 2>/dev/null || true
  kill "$fetching" 2>/dev/null || true
  rm -rf "$site"
  exit "$rc"
}
trap end_fetch EXIT
ruff check .
ruff format --check .
python scripts/gen_protos.py --check
# The docs site (mkdocs.yml), strict: a broken link or anchor fails; seconds. Built into a temporary
# folder; the config reference page comes from the schema just checked (scripts/docs_hooks.py).
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
wait "$fetching" || echo "fetching the tests' packages failed ($cache/fetch.log): the tests that need them are skipped" >&2
# Two workers by default (RELAYRL_TEST_WORKERS; 0 runs in one process): a test file goes whole to
# one worker, so its module fixtures (a warm-started model, a running stack) are built once; the
# longest files go first (tests/conftest.py, LONGEST_FILES), in that order (no reordering by size).
workers="${RELAYRL_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
  python -m pytest "$@"
else
  python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
