"""aiperf (a load generator kvmesh did not write) drives a kvmesh fleet through the router unchanged.

Runs when aiperf is installed in its own virtualenv ($KVMESH_AIPERF, .venv-aiperf/bin/aiperf, or on
PATH); see docs/bench.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _aiperf() -> str | None:
    for candidate in (os.environ.get("KVMESH_AIPERF"), str(ROOT / ".venv-aiperf" / "bin" / "aiperf")):
        if candidate and Path(candidate).is_file():
            return candidate
    return shutil.which("aiperf")


@pytest.mark.slow
@pytest.mark.skipif(_aiperf() is None, reason="aiperf not installed (see docs/bench.md)")
def test_aiperf_drives_the_router(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_peer_aiperf.py"), "--aiperf", str(_aiperf()),
         "--engines", "2", "--emulate", "tiny-h100", "--requests", "40", "--concurrency", "4",
         "--run-dir", str(tmp_path / "run"), "--timeout", "240"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["aiperf"]["request_count.avg"] == 40
    assert out["aiperf"]["time_to_first_token.avg"] > 0
    # aiperf's prompts share 4 prefixes of 512 tokens: the engines must have served some from cache
    assert out["fleet_prefix_cache_hit_rate"] > 0
