"""`kvmesh up` end to end: a fleet comes up, serves through the router, and Ctrl-C leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from fleet_helpers import pid_alive

pytestmark = pytest.mark.slow


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_up_serves_then_stops_everything_on_sigint(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "up", "--engines", "2", "--model", "tiny-random-llama",
         "--emulate", "tiny-h100", "--policy", "round-robin", "--port", "0", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    manifest_path = run_dir / "fleet.json"
    try:
        deadline = time.monotonic() + 120
        while not manifest_path.exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "fleet did not come up"
            time.sleep(0.2)
        manifest = json.loads(manifest_path.read_text())
        pids = [e["pid"] for e in manifest["engines"]]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        assert manifest["store_url"] == (run_dir / "shared").resolve().as_uri()
        with urllib.request.urlopen(manifest["router_url"] + "/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        out = _post(
            manifest["router_url"] + "/v1/completions",
            {"model": model, "prompt": [120, 121, 122, 123], "max_tokens": 3, "ignore_eos": True},
        )
        assert out["usage"]["completion_tokens"] == 3
        assert (run_dir / "logs" / "router.log").read_text().startswith("$ ")
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0, proc.stdout.read().decode() if proc.stdout else ""
    time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids)


def test_up_reports_an_engine_that_cannot_start(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", "up", "--engines", "1", "--emulate", "no-such-preset", "--port", "0",
         "--run-dir", str(tmp_path), "--health-timeout", "60"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200"),
    )  # fmt: skip
    assert result.returncode == 1
    assert "engine-0 exited with code" in result.stdout
    assert "no-such-preset" in result.stdout
