#!/usr/bin/env bash
# Peer tools kvmesh is tested against, each in its own virtualenv (they pin conflicting versions).
# aiperf: a load generator that drives a kvmesh fleet through the router unchanged.
# sglang-router, vllm-router: routers that front kvmesh engines unchanged (benchmarks/router_peers.py).
# A peer that cannot be installed is left out with a warning; its tests are skipped.
set -uo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.."

# install_peer VENV PROBE REQUIREMENT: PROBE is a file inside VENV that exists once it is installed.
install_peer() {
  local venv="$1" probe="$2" requirement="$3" log
  if [ -e "$venv/$probe" ]; then
    return 0
  fi
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  log="$(mktemp)"
  if ! "$venv/bin/pip" install -q "$requirement" >"$log" 2>&1 || [ ! -e "$venv/$probe" ]; then
    tail -20 "$log" >&2
    echo "warning: $requirement could not be installed; its peer tests will be skipped" >&2
    rm -rf "$venv"
  fi
  rm -f "$log"
}

install_peer .venv-aiperf bin/aiperf "aiperf>=0.13,<0.14"
install_peer .venv-sglang-router bin/sglang-router "sglang-router==0.3.2"
install_peer .venv-vllm-router bin/vllm-router "vllm-router==0.1.17"
exit 0
