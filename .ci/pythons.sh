#!/usr/bin/env bash
# Pythons stage: every interpreter on this machine from the package's floor (setup.cfg's python_requires)
# to 3.13, other than the main one (stage 1 ran the whole default suite on it), gets a venv of its own, the
# README's install command and a representative subset of the default suite (PYTHONS_TESTS; the whole
# suite is about 5 minutes per interpreter, more than CI's budget holds). An interpreter below the floor,
# if the machine has one, must refuse the install with pip's one line naming the floor.
# Usage: .ci/pythons.sh [WORK_DIR]   (venvs go under it; default a temporary directory, removed after)
# Interpreters are looked up as python3.N on PATH, then under pyenv's versions; each one missing, or the
# main one, is named with the reason it is skipped. Any install or test failure fails the stage.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
work=${1:-}
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT  # a venv with torch is several GB
fi
mkdir -p "$work"
# Fast files that cover what differs between interpreters: the grader's regexes, enums and flags, the env,
# rewards, the sandbox's processes, the losses, and one end-to-end training run through train_math.py.
tests=${PYTHONS_TESTS:-tests/test_grader.py tests/test_grader_hostile.py tests/test_config.py tests/test_env.py
  tests/test_rewards.py tests/test_sandbox.py tests/test_losses.py tests/test_train_math.py}

floor=$(sed -n 's/^python_requires *= *>= *3\.\([0-9]*\).*/\1/p' setup.cfg)
[ -n "$floor" ] || { echo "no 'python_requires = >=3.N' in setup.cfg" >&2; exit 1; }
main=$(python3 -c 'import sys; print(sys.version_info.minor)')
test_command=$(awk '/<!-- test-command -->/ {getline; getline; print; exit}' README.md)
install_command=${test_command%% && *}  # the README's pip install, without the pytest after it

find_python() {  # an interpreter of 3.$1 that runs (a pyenv shim of a version not selected does not), or nothing
  local candidate
  for candidate in "$(command -v "python3.$1" || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3."$1".*/bin/python; do
    if [ -x "$candidate" ] && [ "$("$candidate" -c 'import sys; print(sys.version_info[1])' 2>/dev/null)" = "$1" ]; then
      echo "$candidate"
      return
    fi
  done
}

below=$(find_python $((floor - 1)))
if [ -n "$below" ]; then
  echo "== 3.$((floor - 1)) (below the floor): $below must refuse the install"
  "$below" -m venv "$work/venv-3.$((floor - 1))"
  refusal=$("$work/venv-3.$((floor - 1))/bin/pip" install --no-deps -e . 2>&1 || true)
  grep -F "requires a different Python" <<<"$refusal" || { echo "$refusal" | tail -n 20; exit 1; }
else
  echo "SKIP 3.$((floor - 1)) (below the floor): no python3.$((floor - 1)) on PATH or under pyenv"
fi

# One interpreter at a time: install, then its tests. The installs share one pip cache in the work dir, so the
# CUDA libraries that PyPI's torch wheels for these interpreters pull in are downloaded once.
export PIP_CACHE_DIR="$work/pip-cache"
for minor in $(seq "$floor" 13); do
  if [ "$minor" = "$main" ]; then
    echo "SKIP 3.$minor: the main interpreter (python3); stage 1 ran the whole default suite on it"
    continue
  fi
  python=$(find_python "$minor")
  if [ -z "$python" ]; then
    echo "SKIP 3.$minor: no python3.$minor on PATH or under pyenv"
    continue
  fi
  venv="$work/venv-3.$minor"
  echo "== 3.$minor: $python; installing with: $install_command"
  "$python" -m venv "$venv"
  if ! (source "$venv/bin/activate" && bash -c "$install_command" >"$venv/install.log" 2>&1); then
    echo "3.$minor: the install failed; its last lines:"
    tail -n 30 "$venv/install.log"
    exit 1
  fi
  echo "== 3.$minor: pytest on" $tests
  # shellcheck disable=SC2086  # the file list splits on whitespace
  (source "$venv/bin/activate" && python -m pytest -p no:cacheprovider -q $tests)
  rm -rf "$venv"  # several GB; the next interpreter's install reads the shared cache
done
