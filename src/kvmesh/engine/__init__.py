"""Pillar 3: the reference replica (real model or emulated GPU) with a device-tier prefix cache.

The pieces the fleet simulator drives directly are re-exported here (pure, no I/O):
:class:`PrefixCache`, :class:`CostModel` and its presets. The server, the scheduler and the runners
live in their own modules (``kvmesh.engine.server``, ``.scheduler``, ``.emulated_runner``,
``.torch_runner``) and ``kvmesh.engine.app.build_engine`` assembles them.
"""

from kvmesh.engine.cost_model import PRESETS, CostModel, CostPreset, get_preset
from kvmesh.engine.prefix_cache import Allocation, PrefixCache, engine_block_hash

__all__ = [
    "PRESETS",
    "Allocation",
    "CostModel",
    "CostPreset",
    "PrefixCache",
    "engine_block_hash",
    "get_preset",
]
