"""Discrete-event fleet simulator built on the engine's cost model and the router's own code.

Replicas are the engine's :class:`~kvmesh.engine.cost_model.CostModel` and
:class:`~kvmesh.engine.prefix_cache.PrefixCache` driven by a continuous-batching scheduler in
virtual time; routing is the router's :class:`~kvmesh.router.scheduler.Scheduler` over an index fed
by the replicas' KV events; inputs are the bench workloads and outputs the bench metrics.

    from kvmesh.sim import FleetConfig, simulate, build_report
    report = build_report(simulate(FleetConfig(num_replicas=8, policy="precise"), workload))
"""

from kvmesh.sim.fleet import FleetConfig, FleetRun, FleetSimulation, simulate
from kvmesh.sim.presets import PRESETS, ScenarioPreset, get_scenario
from kvmesh.sim.report import SimReport, build_report
from kvmesh.sim.sweep import SweepPoint, plot_sweep, run_sweep

__all__ = [
    "PRESETS",
    "FleetConfig",
    "FleetRun",
    "FleetSimulation",
    "ScenarioPreset",
    "SimReport",
    "SweepPoint",
    "build_report",
    "get_scenario",
    "plot_sweep",
    "run_sweep",
    "simulate",
]
