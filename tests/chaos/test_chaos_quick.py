"""``kvmesh chaos --quick`` end to end: every scenario runs against a real fleet and holds its bounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmesh.chaos.harness import SCENARIOS
from kvmesh.store.local_server import find_server_binary

pytestmark = [
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.skipif(find_server_binary("redis") is None, reason="needs redis-server"),
]


def test_quick_chaos_run_passes_every_scenario(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh", "chaos", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200"),
    )
    report_path = out / "chaos-report.json"
    assert report_path.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    failed = {
        s["name"]: s["error"] or [b for b in s["bounds"] if not b["passed"]]
        for s in report["scenarios"]
        if not s["passed"]
    }
    assert failed == {}, proc.stdout[-4000:]
    assert [s["name"] for s in report["scenarios"]] == list(SCENARIOS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert report["mode"] == "quick"
    assert {f["name"] for f in report["faults"]} >= {
        "redis SIGKILL",
        "redis SIGSTOP",
        "engine-1 SIGKILL",
        "router restart",
        "rolling restart: router workers",
        "rolling restart: engines",
    }
    assert (out / "chaos-timeline.png").read_bytes()[:4] == b"\x89PNG"
