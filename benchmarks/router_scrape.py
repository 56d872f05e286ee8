"""What reading one endpoint's ``GET /metrics`` page costs the router, per scrape.

    .venv/bin/python benchmarks/router_scrape.py [--json]

The page is shaped as vLLM 0.32 prints it for one engine (its 19 histograms with their buckets,
``_sum``, ``_count`` and ``_created`` lines, the gauges and counters, ``vllm:cache_config_info`` and
``vllm:lora_requests_info``, labels ``engine`` and ``model_name``). Compared: a pass over every line
(:func:`~kvmesh.router.exposition.parse_prometheus_gauges`, what the scrape did before) and what
the scrape does now (:func:`~kvmesh.router.exposition.gauge_totals` of the three load gauges, the
LoRA sample and the cache-config lines, each found by name). CPU time of this process.
"""

from __future__ import annotations

import argparse
import json
import time

from kvmesh.router.cache_config import cache_config_samples
from kvmesh.router.exposition import gauge_totals, parse_prometheus_gauges
from kvmesh.router.lora_state import parse_lora_info

LABELS = 'engine="0",model_name="Qwen/Qwen3-32B"'
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def vllm_like_page(histograms: int = 19, buckets: int = 20, scalars: int = 30) -> str:
    lines: list[str] = []
    for i in range(scalars):
        name = GAUGES[i] if i < len(GAUGES) else f"vllm:metric_{i}"
        lines += [f"# HELP {name} A figure.", f"# TYPE {name} gauge", f"{name}{{{LABELS}}} {i}.0"]
    for h in range(histograms):
        name = f"vllm:histogram_{h}"
        lines += [f"# HELP {name} A distribution.", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{{LABELS},le="{2.0**b}"}} {b}.0' for b in range(buckets)]
        lines += [f'{name}_bucket{{{LABELS},le="+Inf"}} 20.0', f"{name}_count{{{LABELS}}} 20.0"]
        lines += [f"{name}_sum{{{LABELS}}} 123.5", f"{name}_created{{{LABELS}}} 1.7e9"]
    lines += [
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="20000",{LABELS}}} 1.0',
        "# TYPE vllm:lora_requests_info gauge",
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9',
    ]
    return "\n".join(lines) + "\n"


def per_scrape_us(fn, text: str, rounds: int) -> float:
    start = time.process_time()
    for _ in range(rounds):
        fn(text)
    return (time.process_time() - start) / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    text = vllm_like_page()

    def by_name(page: str) -> None:
        gauge_totals(page, GAUGES)
        parse_lora_info(page)
        cache_config_samples(page)

    result = {
        "page_lines": text.count("\n"),
        "page_bytes": len(text.encode()),
        "every_line_us": per_scrape_us(parse_prometheus_gauges, text, args.rounds),
        "by_name_us": per_scrape_us(by_name, text, args.rounds),
    }
    result["speedup"] = result["every_line_us"] / result["by_name_us"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"page {result['page_lines']} lines, {result['page_bytes']:,} bytes: every line "
            f"{result['every_line_us']:.0f} µs, by name {result['by_name_us']:.1f} µs per scrape "
            f"({result['speedup']:.0f}× less)"
        )


if __name__ == "__main__":
    main()
