"""The container image: pinned dependencies, a model directory that serves, and (opt-in, with podman
or a Docker engine) a real build whose router answers in front of an engine from the same image."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
import uuid
from pathlib import Path

import aiohttp
import pytest
from deploy_paths import DEPLOY, REPO
from image_build import (
    BUILD_TIMEOUT_S,
    build_image,
    container_logs,
    container_runtime,
    image_test_skip_reason,
    post_until_served,
    python_base,
    start_container,
)

from kvmesh.core.models import resolve_model
from kvmesh.core.net import free_ports
from kvmesh.core.tenancy import ENDPOINT_HEADER
from kvmesh.core.tokens import Tokenizer
from kvmesh.engine.app import EngineOptions, build_engine

DOCKERFILE = REPO / "Dockerfile"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not pinned with =="
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_runtime_dependency_is_pinned() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins(DEPLOY / "image" / "requirements.txt")
    for dep in project["dependencies"]:
        name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pins, f"{name} is a dependency of kvmesh but not pinned for the image"
    assert "torch" not in pins  # the image tokenizes; it never runs a model


def _copied_model_files() -> list[str]:
    """The files the Dockerfile's model stage keeps from the converted SmolLM2."""
    match = re.search(r"cp ((?:[\w.-]+ )+)/out/smollm2/", DOCKERFILE.read_text())
    assert match, "the Dockerfile no longer copies SmolLM2's files to /out/smollm2/"
    return match.group(1).split()


async def test_the_images_model_directory_serves_an_emulated_engine(tmp_path: Path) -> None:
    converted = resolve_model("smollm2").path
    model_dir = tmp_path / "smollm2"
    model_dir.mkdir()
    for name in _copied_model_files():
        shutil.copy(converted / name, model_dir / name)
    assert not list(model_dir.glob("*.safetensors"))  # no weights in the image

    tokenizer = Tokenizer.load(str(model_dir))  # what the router's --tokenizer loads
    assert tokenizer.encode("hello world") == Tokenizer.load("smollm2").encode("hello world")
    engine = await build_engine(EngineOptions(model=str(model_dir), emulate="tiny-h100"))
    await engine.start("127.0.0.1", 0)
    try:
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{engine.url}/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            reply = await r.json()
        assert reply["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        await engine.stop()


def test_the_images_build_from_any_python_base() -> None:
    """Both images take their base from PYTHON_BASE (a registry's or deploy/image/debian-base.sh's)."""
    for dockerfile in (DOCKERFILE, DEPLOY / "vllm" / "Dockerfile.cpu"):
        text = dockerfile.read_text()
        assert "ARG PYTHON_BASE=python:3.11.14-slim-bookworm" in text
        stages = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
        assert stages and set(stages) == {"${PYTHON_BASE}"}, (dockerfile.name, stages)


@pytest.mark.slow
@pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 300)  # the base, then the image, built from nothing
@pytest.mark.skipif(image_test_skip_reason() is not None, reason=str(image_test_skip_reason()))
def test_the_image_builds_and_its_router_serves() -> None:
    runtime = container_runtime()
    assert runtime is not None
    tag = f"localhost/kvmesh-test:{uuid.uuid4().hex[:8]}"
    build_image(runtime, REPO / "Dockerfile", tag, python_base(runtime))
    name = f"kvmesh-test-{uuid.uuid4().hex[:8]}"
    engine_port, router_port = free_ports(2)
    engine_url = f"http://127.0.0.1:{engine_port}"
    # an emulated engine and a router, both from the image, on the host network
    common = [runtime, "run", "-d", "--network", "host"]
    started: list[str] = []
    try:
        started.append(start_container(
            [*common, "--name", f"{name}-engine", "-e", f"KVMESH_HEALTH_URL={engine_url}/health",
             tag, "engine", "--model", "/opt/kvmesh/models/smollm2", "--emulate", "tiny-h100",
             "--host", "127.0.0.1", "--port", str(engine_port), "--events", "tcp://127.0.0.1:0"],
        ))  # fmt: skip
        started.append(start_container(
            [*common, "--name", f"{name}-router", tag, "router", "--host", "127.0.0.1", "--port",
             str(router_port), "--endpoints", engine_url, "--tokenizer", "/opt/kvmesh/models/smollm2"],
        ))  # fmt: skip
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}
        status, headers, reply = post_until_served(
            f"http://127.0.0.1:{router_port}/v1/chat/completions", body
        )
        logs = "".join(container_logs(runtime, c) for c in started)
        assert status == 200, (reply, logs)
        assert reply["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert reply["usage"]["completion_tokens"] == 3
        assert headers.get(ENDPOINT_HEADER) == engine_url, (dict(headers), logs)
        running = subprocess.run(
            [runtime, "inspect", "--format", "{{.Config.User}}", started[0]], capture_output=True, text=True
        )
        assert running.stdout.strip() == "10001:10001"
    finally:
        for container in started:
            subprocess.run([runtime, "rm", "-f", container], capture_output=True)
        subprocess.run([runtime, "rmi", "-f", tag], capture_output=True)
