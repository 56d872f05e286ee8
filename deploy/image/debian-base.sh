#!/usr/bin/env bash
# Build the image's Python base from Debian's mirrors, for hosts that reach Debian and PyPI but no
# container registry (docker.io's python:3.11-slim-bookworm cannot be pulled there).
#
#   sudo deploy/image/debian-base.sh [TAG]          # default localhost/kvmesh-python:3.11-bookworm
#   podman build --build-arg PYTHON_BASE=localhost/kvmesh-python:3.11-bookworm ...
#
# The result stands in for python:3.11-slim-bookworm as the Dockerfile uses it: Debian bookworm's
# python3.11 (minbase), `python` and `pip` from a virtualenv at /opt/python first on PATH (Debian's
# own pip refuses system-wide installs), and useradd. Needs root, buildah and debootstrap.
set -euo pipefail
TAG="${1:-localhost/kvmesh-python:3.11-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm

ctr="$(buildah from scratch)"
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
root="$(buildah mount "$ctr")"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR"
chroot "$root" python3 -m venv /opt/python
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
buildah umount "$ctr" >/dev/null
buildah config \
  --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 \
  --cmd python3 \
  --label org.opencontainers.image.description="Debian ${SUITE} python3.11 with a virtualenv on PATH (kvmesh's local base)" \
  "$ctr"
buildah commit --quiet "$ctr" "$TAG" >/dev/null
echo "$TAG"
