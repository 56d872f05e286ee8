"""The llm-d capacity presets, simulated with every scheduler, next to the published figures.

    .venv/bin/python benchmarks/sim_llmd.py --preset llmd-73-capacity [--policies precise,random]
        [--plots docs/] [--json out.json]

Prints a markdown table (simulated | published | ratio) for docs/benchmarks/sim.md and, with
``--plots``, writes ``sim_<preset>_stages.png`` (p90 TTFT and throughput per load stage) and
``sim_<preset>_ttft_cdf.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvmesh.bench.report import plot_stage_curves, plot_ttft_cdf
from kvmesh.sim.fleet import simulate
from kvmesh.sim.presets import Published, get_scenario
from kvmesh.sim.report import SimReport, build_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llmd-73-capacity")
    ap.add_argument("--policies", default="llmd-precise,approximate,load,random")
    ap.add_argument("--plots", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    scenario = get_scenario(args.preset)
    reports: dict[str, SimReport] = {}
    print(f"### {scenario.name}: {scenario.description}\n")
    how = (
        "llm-d's report rows: per-stage p90 and mean TTFT weighted by the stage's requests, per-stage "
        "throughput averaged, warm-up excluded"
        if scenario.aggregation == "stages"
        else "every request of the run pooled"
    )
    print(f"Aggregation: {how}.\n")
    print(
        "| scheduler | TTFT p90 s sim | pub | ratio | out tok/s sim | pub | ratio | TTFT mean s sim | pub "
        "| ITL mean s sim | pub | queue mean sim | pub | hit rate | pooled p90 s | sim wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        rep = build_report(simulate(scenario.fleet_for(policy), scenario.workload), policy)
        reports[policy] = rep
        s, h, pub = rep.summary, scenario.headline(rep), scenario.published.get(policy)

        def fmt(x: float | None) -> str:
            return "–" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")

        p = pub if pub is not None else Published(float("nan"), float("nan"))
        print(
            f"| {policy} | {fmt(h.ttft_p90_s)} | {fmt(p.ttft_p90_s)} | {fmt(h.ttft_p90_s / p.ttft_p90_s)} | "
            f"{h.output_tok_s:.0f} | {fmt(p.output_tok_s)} | {fmt(h.output_tok_s / p.output_tok_s)} | "
            f"{fmt(h.ttft_mean_s)} | {fmt(p.ttft_mean_s)} | {fmt(s.itl.mean)} | {fmt(p.itl_mean_s)} | "
            f"{s.queue_mean:.1f} | {fmt(p.queue_mean)} | {s.hit_rate:.3f} | {fmt(s.ttft.p90)} | {rep.wall_s:.0f} s |",
            flush=True,
        )
    print("\nPer stage (offered QPS: simulated p90 TTFT s; published where the report gives it):\n")
    for policy, rep in reports.items():
        cells = ", ".join(
            f"{st.offered_rate:g}: {st.ttft.p90:.2f}" for st in rep.run.stages if st.offered_rate
        )
        print(f"- {policy}: {cells}")
        published_stages = scenario.published_stage_p90.get(policy)
        if published_stages:
            print(f"  - published (after warm-up): {', '.join(f'{x:g}' for x in published_stages)}")
    print("\nPeak KV-cache usage per stage, % (simulated; published read off the per-pod plots):\n")
    for policy, rep in reports.items():
        cells = ", ".join(
            f"{st.offered_rate:g}: {peak * 100:.0f}"
            for st, peak in zip(rep.run.stages, rep.stage_kv_peak, strict=True)
            if st.offered_rate
        )
        print(f"- {policy}: {cells}")
        published_kv = scenario.published_stage_kv_peak.get(policy)
        if published_kv:
            shown = ", ".join("–" if x is None else f"{x * 100:.0f}" for x in published_kv)
            print(f"  - published (warm-up first): {shown}")
    runs = {k: r.run for k, r in reports.items()}
    if args.plots:
        name = scenario.name.replace("-", "_")
        plot_stage_curves(runs, args.plots / f"sim_{name}_stages.png", title=f"simulated {scenario.name}")
        plot_ttft_cdf(
            runs, args.plots / f"sim_{name}_ttft_cdf.png", title=f"simulated {scenario.name}: TTFT CDF"
        )
    if args.json:
        args.json.write_text(json.dumps({k: r.to_dict() for k, r in reports.items()}, indent=2))


if __name__ == "__main__":
    main()
