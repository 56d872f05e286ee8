"""Pillar 3: the reference replica (real model or emulated GPU) with a device-tier prefix cache.

The pieces the fleet simulator drives directly are re-exported here (pure, no I/O):
:class:`StepScheduler` (the scheduling policy), :class:`PrefixCache`, :class:`CostModel` and its
presets. The async core that drives the scheduler on a runner, the server and the runners live in
their own modules (``kvmesh.engine.core``, ``.server``, ``.emulated_runner``, ``.torch_runner``) and
``kvmesh.engine.app.build_engine`` assembles them.
"""

from kvmesh.engine.cost_model import PRESETS, CostModel, CostPreset, get_preset
from kvmesh.engine.prefix_cache import Allocation, PrefixCache, engine_block_hash
from kvmesh.engine.step_scheduler import (
    BatchLimits,
    Release,
    ScheduledRequest,
    SchedulerHooks,
    SchedulerOutput,
    StepScheduler,
)

__all__ = [
    "PRESETS",
    "Allocation",
    "BatchLimits",
    "CostModel",
    "CostPreset",
    "PrefixCache",
    "Release",
    "ScheduledRequest",
    "SchedulerHooks",
    "SchedulerOutput",
    "StepScheduler",
    "engine_block_hash",
    "get_preset",
]
