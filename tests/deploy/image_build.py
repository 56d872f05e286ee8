"""Building kvmesh's images with podman or Docker for the image test, and talking to what runs.

The test is opt-in (``KVMESH_IMAGE_TEST=1``): a first build takes minutes. Where no registry is
reachable, the Python base is built from Debian's mirrors by ``deploy/image/debian-base.sh`` (root,
buildah, debootstrap); the host's pip settings (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``PIP_CERT``,
``KVMESH_TORCH_INDEX_URL``) reach the build as build args, with the find-links folder and the
certificate mounted read-only (podman) so pip in the build resolves as it does on the host.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from deploy_paths import DEPLOY, REPO

OPT_IN = "KVMESH_IMAGE_TEST"
UPSTREAM_BASE = "python:3.11.14-slim-bookworm"
LOCAL_BASE = "localhost/kvmesh-python:3.11-bookworm"
BASE_SCRIPT = DEPLOY / "image" / "debian-base.sh"
BUILD_TIMEOUT_S = 1800


@functools.cache
def container_runtime() -> str | None:
    """``podman`` if it answers ``info``, else ``docker`` if its engine does, else ``None``."""
    for tool in ("podman", "docker"):
        if shutil.which(tool) and subprocess.run([tool, "info"], capture_output=True).returncode == 0:
            return tool
    return None


@functools.cache
def image_test_skip_reason() -> str | None:
    """Why the image test cannot run here (``None``: it can)."""
    if os.environ.get(OPT_IN) != "1":
        return f"the image test builds images for minutes: set {OPT_IN}=1 to run it"
    if container_runtime() is not None:
        return None
    reasons = []
    if shutil.which("podman") is None:
        reasons.append("no podman (scripts/system-deps.sh installs it: apt-get install podman buildah)")
    else:
        reasons.append("`podman info` failed")
    if shutil.which("docker") is None:
        reasons.append("no docker client")
    else:
        reasons.append("no Docker engine reachable (`docker info` failed)")
    return "; ".join(reasons)


def _has_image(runtime: str, ref: str) -> bool:
    return subprocess.run([runtime, "image", "inspect", ref], capture_output=True).returncode == 0


def python_base(runtime: str) -> str:
    """The base to build on: ``KVMESH_IMAGE_BASE``, else the registry's python image if it is
    present or can be pulled, else the local Debian-built one (built now if missing)."""
    chosen = os.environ.get("KVMESH_IMAGE_BASE")
    if chosen:
        return chosen
    if _has_image(runtime, UPSTREAM_BASE):
        return UPSTREAM_BASE
    pull = subprocess.run([runtime, "pull", UPSTREAM_BASE], capture_output=True, text=True, timeout=300)
    if pull.returncode == 0:
        return UPSTREAM_BASE
    if _has_image(runtime, LOCAL_BASE):
        return LOCAL_BASE
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        raise RuntimeError(
            f"{UPSTREAM_BASE} cannot be pulled ({pull.stderr.strip()[-300:]}) and {LOCAL_BASE} is "
            f"missing; build it as root with {BASE_SCRIPT.relative_to(REPO)} (needs buildah, debootstrap)"
        )
    subprocess.run(["bash", str(BASE_SCRIPT), LOCAL_BASE], check=True, timeout=BUILD_TIMEOUT_S)
    if runtime == "docker":  # buildah commits to podman's store; Docker needs it loaded
        saved = subprocess.run(["podman", "save", LOCAL_BASE], check=True, capture_output=True)
        subprocess.run(["docker", "load"], input=saved.stdout, check=True, capture_output=True)
    return LOCAL_BASE


def _pip_routing(runtime: str) -> list[str]:
    """Build args (and podman mounts) that give the build's pip the host's index, wheels and CA."""
    args = []
    for name in ("PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"):
        value = os.environ.get(name)
        if not value:
            continue
        args += ["--build-arg", f"{name}={value}"]
        path = Path(value)
        if runtime == "podman" and name != "PIP_INDEX_URL" and path.is_absolute() and path.exists():
            args += ["--volume", f"{path}:{path}:ro"]
    torch_index = os.environ.get("KVMESH_TORCH_INDEX_URL")
    if torch_index:
        args += ["--build-arg", f"TORCH_INDEX_URL={torch_index}"]
    return args


def build_image(runtime: str, dockerfile: Path, tag: str, base: str) -> None:
    """Build ``dockerfile`` from the repository root as ``tag`` on ``base`` (host network)."""
    # podman's default OCI format drops HEALTHCHECK; Docker's keeps it
    image_format = ["--format", "docker"] if runtime == "podman" else []
    subprocess.run(
        [runtime, "build", *image_format, "--network", "host", "-f", str(dockerfile), "-t", tag,
         "--build-arg", f"PYTHON_BASE={base}", *_pip_routing(runtime), str(REPO)],
        check=True, timeout=BUILD_TIMEOUT_S,
    )  # fmt: skip


def start_container(argv: list[str]) -> str:
    """Run ``argv`` (a detached ``run``); the container id, or an error with the runtime's words."""
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:3])} failed ({out.returncode}): {out.stderr.strip()[-1500:]}")
    return out.stdout.strip()


def container_logs(runtime: str, container: str) -> str:
    out = subprocess.run([runtime, "logs", container], capture_output=True, text=True)
    return out.stdout[-2000:] + out.stderr[-2000:]


def post_until_served(
    url: str, body: dict[str, Any], timeout_s: float = 120.0
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """POST ``body`` as JSON until something answers (the containers are starting); the status,
    headers and decoded body of the first answer."""
    data = json.dumps(body).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                text = exc.read().decode(errors="replace")
                try:
                    return exc.code, dict(exc.headers), json.loads(text)
                except ValueError:
                    return exc.code, dict(exc.headers), {"body": text}
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(1)
