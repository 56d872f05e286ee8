#!/usr/bin/env bash
# Debian packages kvmesh's tests and demo use: a real redis-server.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server >/dev/null
# The package starts a system service; kvmesh starts its own servers on ephemeral ports.
($SUDO service redis-server stop || true) >/dev/null 2>&1
command -v redis-server
