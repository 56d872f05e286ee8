#!/usr/bin/env bash
# Debian packages kvmesh's tests and demo use: a real redis-server; podman, buildah, debootstrap
# and runc for the opt-in image test (KVMESH_IMAGE_TEST=1, tests/deploy/test_deploy_image.py),
# which builds the images and, where no registry answers, their Python base from Debian's mirrors
# (deploy/image/debian-base.sh); runc is for hosts where crun cannot start containers
# (docs/deploy.md). Root (or sudo) only; `make test` does not run this.
set -euo pipefail
declare -A wanted=([redis-server]=redis-server [podman]=podman [buildah]=buildah [debootstrap]=debootstrap [runc]=runc)
missing=()
for tool in "${!wanted[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("${wanted[$tool]}")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
# The package starts a system service; kvmesh starts its own servers on ephemeral ports.
($SUDO service redis-server stop || true) >/dev/null 2>&1
command -v redis-server podman buildah
