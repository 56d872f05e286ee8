"""Fixtures of the deploy/ checks: the tools' virtualenv, kubectl, rendered overlays."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from deploy_paths import DEPLOY_PYTHON, OVERLAYS, render


@pytest.fixture(scope="session")
def deploy_python() -> Path:
    """The interpreter with kubernetes-validate, checkov and grafana-foundation-sdk."""
    if not DEPLOY_PYTHON.is_file():
        pytest.fail(f"{DEPLOY_PYTHON} is missing: run `make deploy-tools` (make test does)")
    return DEPLOY_PYTHON


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is missing: run `make deploy-tools` (make test does)")
    return path


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(kubectl, overlay) for overlay in OVERLAYS}
