"""Paths of deploy/ and the tools that check it (shared by the deploy tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kustomize" / "overlays").iterdir() if p.is_dir())
DEPLOY_PYTHON = REPO / ".venv-deploy" / "bin" / "python"


def render(kubectl: str, overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects, as ``kubectl kustomize`` renders them."""
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "kustomize" / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]
