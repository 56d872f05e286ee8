"""Former home of the trace token blocks, now :mod:`kvmesh.workload.trace_blocks`; the simulator's
replica still names :class:`PromptBlocks` through it."""

from kvmesh.workload.trace_blocks import PromptBlocks

__all__ = ["PromptBlocks"]
