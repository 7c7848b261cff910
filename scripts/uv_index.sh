# shellcheck shell=bash
# uv reads no pip configuration: the pip variables that point at indexes and wheel folders, handed
# to uv as arguments (uv_index), for scripts/install.sh and scripts/test.sh alike. Sourced.
uv_index=()
for links in ${PIP_FIND_LINKS:-}; do uv_index+=(--find-links "$links"); done
[ -z "${PIP_INDEX_URL:-}" ] || uv_index+=(--index-url "$PIP_INDEX_URL")
# torch's index and PyPI both serve some packages: take the best version of either, as pip does
[ -z "${PIP_EXTRA_INDEX_URL:-}" ] || uv_index+=(--extra-index-url "$PIP_EXTRA_INDEX_URL" --index-strategy unsafe-best-match)
