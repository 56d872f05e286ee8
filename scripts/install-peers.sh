#!/usr/bin/env bash
# Peer tools kvmesh is tested against, each in its own virtualenv (they pin conflicting versions).
# aiperf: a load generator that drives a kvmesh fleet through the router unchanged.
set -uo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.."
if [ -x .venv-aiperf/bin/aiperf ]; then
  exit 0
fi
"$PYTHON" -m venv .venv-aiperf
LOG="$(mktemp)"
if ! .venv-aiperf/bin/pip install -q "aiperf>=0.13,<0.14" >"$LOG" 2>&1; then
  tail -20 "$LOG" >&2
  echo "warning: aiperf could not be installed; its peer test will be skipped" >&2
  rm -rf .venv-aiperf
fi
rm -f "$LOG"
exit 0
