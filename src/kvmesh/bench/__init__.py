"""Benchmark harness: workloads, open/closed-loop runner, vLLM-defined metrics, reports.

The names below are the pure parts the simulator shares (per-request results, their summaries, the
named llm-d runs). The load runner (``runner``: HTTP), the scheduler comparison on a live fleet
(``compare``), the tables and plots (``report``) and the engines' route counts (``route_counts``) are
imported from their modules. Workloads themselves live in :mod:`kvmesh.workload`.
"""

from kvmesh.bench.metrics import (
    Dist,
    QueueSample,
    RequestResult,
    RunResult,
    Summary,
    summarize,
    summarize_stages,
)
from kvmesh.bench.presets import PRESETS, ScaledRun, llmd_73, llmd_73_scaled

__all__ = [
    "PRESETS",
    "Dist",
    "QueueSample",
    "RequestResult",
    "RunResult",
    "ScaledRun",
    "Summary",
    "llmd_73",
    "llmd_73_scaled",
    "summarize",
    "summarize_stages",
]
