"""The kvmesh Grafana dashboard, built with grafana-foundation-sdk; writes kvmesh-dashboard.json.

    .venv-deploy/bin/python deploy/grafana/dashboard.py            # rewrite the JSON next to this file
    .venv-deploy/bin/python deploy/grafana/dashboard.py --check    # exit 1 if the JSON is stale

Every query reads metrics the routers (``kvmesh_router_*``) and the engines export: vLLM's names,
which kvmesh engines export too, plus ``kvmesh:*`` (engine) and ``kvmesh_store_*`` (the store of a
kvmesh engine serving a real model). tests/deploy checks each name against a live scrape. Panels
per pod group by ``pod``, the label Prometheus Operator's PodMonitor adds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueColorMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).with_name("kvmesh-dashboard.json")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "5m"


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).range()


def quantiles(metric: str, by: str = "") -> list[prometheus.Dataquery]:
    """p50/p90/p99 of a histogram, fleet-wide (or per ``by``)."""
    group = f"le{', ' + by if by else ''}"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [
        query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))",
            f"{prefix}p{round(q * 100)}",
            ref,
        )
        for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))
    ]


def series(
    title: str, unit: str, queries: list[prometheus.Dataquery], description: str = ""
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(8)
    if description:
        panel = panel.description(description)
    for q in queries:
        panel = panel.with_target(q)
    return panel


def big_number(title: str, unit: str, expr: str, description: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .color_mode(BigValueColorMode.VALUE)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(query(expr))
    )


def build() -> dashboard.Dashboard:
    hit_rate = f"sum(rate(vllm:prefix_cache_hits_total[{RATE}])) / sum(rate(vllm:prefix_cache_queries_total[{RATE}]))"
    board = (
        dashboard.Dashboard("kvmesh")
        .uid("kvmesh-fleet")
        .tags(["kvmesh", "vllm", "kv-cache"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )

    board = board.with_row(dashboard.Row("Fleet"))
    for panel in (
        big_number("Prefix hit rate", "percentunit", hit_rate, "Prompt tokens the engines found cached."),
        big_number(
            "Router hit rate",
            "percentunit",
            f"sum(rate(kvmesh_router_realized_hit_tokens_total[{RATE}]))"
            f" / sum(rate(kvmesh_router_prompt_tokens_total[{RATE}]))",
            "Cached tokens the engines reported in responses, over prompt tokens routed.",
        ),
        big_number(
            "TTFT p90",
            "s",
            f"histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[{RATE}])))",
            "Time to first token, every engine.",
        ),
        big_number(
            "Requests/s",
            "reqps",
            f"sum(rate(kvmesh_router_decisions_total[{RATE}]))",
            "Requests the routers sent to engines.",
        ),
    ):
        board = board.with_panel(panel)

    board = board.with_row(dashboard.Row("Cache"))
    board = board.with_panel(
        series(
            "Prefix hit rate per pod",
            "percentunit",
            [
                query(
                    f"sum by (pod) (rate(vllm:prefix_cache_hits_total[{RATE}]))"
                    f" / sum by (pod) (rate(vllm:prefix_cache_queries_total[{RATE}]))",
                    "{{pod}}",
                )
            ],
        )
    )
    board = board.with_panel(
        series(
            "Prompt tokens served per tier",
            "percentunit",
            [
                query(
                    f"sum by (tier) (rate(kvmesh:cached_tokens_total[{RATE}]))"
                    f" / ignoring(tier) group_left sum(rate(vllm:prompt_tokens_total[{RATE}]))",
                    "{{tier}}",
                )
            ],
            "Share of prompt tokens found in each cache tier (GPU: the device; CPU, DISK, SHARED: the store).",
        )
    )
    board = board.with_panel(
        series(
            "Predicted vs reported cached tokens",
            "short",
            [
                query(f"sum(rate(kvmesh_router_predicted_hit_tokens_total[{RATE}]))", "index predicted", "A"),
                query(f"sum(rate(kvmesh_router_realized_hit_tokens_total[{RATE}]))", "engines reported", "B"),
            ],
            "Cached prompt tokens per second: what the index expected at routing time against what the "
            "engines reported. A gap means stale or lagging events.",
        )
    )

    board = board.with_row(dashboard.Row("Routing"))
    board = board.with_panel(
        series(
            "Decisions per endpoint",
            "reqps",
            [query(f"sum by (endpoint) (rate(kvmesh_router_decisions_total[{RATE}]))", "{{endpoint}}")],
        )
    )
    board = board.with_panel(
        series(
            "Outstanding prefill tokens",
            "short",
            [query("sum by (endpoint) (kvmesh_router_pending_prefill_tokens)", "{{endpoint}}")],
            "Prompt tokens sent to each endpoint and not yet past their first token (the TTFT scorer's input), summed over every router and router worker (each counts its own requests).",
        )
    )
    board = board.with_panel(
        series(
            "Connections to the engines",
            "short",
            [
                query(
                    "sum by (endpoint, state) (kvmesh_router_upstream_connections)",
                    "{{endpoint}} {{state}}",
                    "A",
                ),
                query(
                    "sum by (endpoint) (kvmesh_router_upstream_waiting_requests)", "{{endpoint}} waiting", "B"
                ),
            ],
            "Request connections from the routers to each endpoint, busy or idle, and requests waiting because upstream.maxConnectionsPerEndpoint is reached (summed over routers and workers).",
        )
    )
    board = board.with_panel(
        series(
            "Errors and retries",
            "reqps",
            [
                query(f"sum by (kind) (rate(kvmesh_router_errors_total[{RATE}]))", "{{kind}}", "A"),
                query(f"sum(rate(kvmesh_router_retries_total[{RATE}]))", "retried elsewhere", "B"),
            ],
        )
    )

    board = board.with_row(dashboard.Row("Latency"))
    board = board.with_panel(
        series("Time to first token", "s", quantiles("vllm:time_to_first_token_seconds"))
    )
    board = board.with_panel(
        series("Inter-token latency", "s", quantiles("vllm:inter_token_latency_seconds"))
    )
    board = board.with_panel(
        series(
            "Router overhead", "s", quantiles("kvmesh_router_schedule_seconds"), "Tokenize, match and pick."
        )
    )

    board = board.with_row(dashboard.Row("Engines"))
    board = board.with_panel(
        series(
            "Queue depth",
            "short",
            [
                query("sum by (pod) (vllm:num_requests_waiting)", "{{pod}} waiting", "A"),
                query("sum by (pod) (vllm:num_requests_running)", "{{pod}} running", "B"),
            ],
        )
    )
    board = board.with_panel(
        series("KV cache usage", "percentunit", [query("max by (pod) (vllm:kv_cache_usage_perc)", "{{pod}}")])
    )
    board = board.with_panel(
        series(
            "Preemptions",
            "short",
            [query(f"sum by (pod) (rate(vllm:num_preemptions_total[{RATE}]))", "{{pod}}")],
            "Requests preempted per second for lack of KV blocks.",
        )
    )

    board = board.with_row(dashboard.Row("Store"))
    board = board.with_panel(
        series(
            "Store throughput",
            "Bps",
            [
                query(
                    f"sum by (tier, direction) (rate(kvmesh_store_bytes_total[{RATE}]))",
                    "{{tier}} {{direction}}",
                )
            ],
        )
    )
    board = board.with_panel(
        series(
            "Breaker state",
            "short",
            [query("max by (pod, tier) (kvmesh_store_breaker_state)", "{{pod}} {{tier}}")],
            "0 closed, 1 half-open, 2 open (the tier is skipped: its reads are misses).",
        )
    )
    board = board.with_panel(
        series(
            "Chunk hits, misses and corruption",
            "short",
            [
                query(f"sum by (tier) (rate(kvmesh_store_chunk_hits_total[{RATE}]))", "{{tier}} hits", "A"),
                query(
                    f"sum by (tier) (rate(kvmesh_store_chunk_misses_total[{RATE}]))", "{{tier}} misses", "B"
                ),
                query(
                    f"sum by (tier) (rate(kvmesh_store_corrupt_chunks_total[{RATE}]))",
                    "{{tier}} corrupt",
                    "C",
                ),
            ],
        )
    )

    board = board.with_row(dashboard.Row("Index"))
    board = board.with_panel(
        series(
            "Indexed blocks per pod",
            "short",
            [query("max by (endpoint) (kvmesh_router_pod_indexed_blocks)", "{{endpoint}}")],
        )
    )
    board = board.with_panel(series("KV event lag", "s", quantiles("kvmesh_router_event_lag_seconds")))
    board = board.with_panel(
        series(
            "Events applied and skipped",
            "short",
            [
                query(f"sum(rate(kvmesh_router_ingest_events_total[{RATE}]))", "applied", "A"),
                query(f"sum(rate(kvmesh_router_ingest_bad_events_total[{RATE}]))", "malformed", "B"),
                query(f"sum(rate(kvmesh_router_ingest_orphans_total[{RATE}]))", "orphan chains", "C"),
            ],
        )
    )
    return board


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON on disk differs from the code")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is stale: run {Path(__file__).name} to rewrite it", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
