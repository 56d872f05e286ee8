"""Launches engines, the router and the shared tier on one machine (``kvmesh up``).

``config`` (:class:`FleetConfig`), ``launcher`` (:class:`Fleet`), ``process`` (supervised child processes), ``vllm`` (real vLLM
replicas) and ``peer_routers`` (other projects' routers in front of a fleet's engines).
"""

from kvmesh.errors import FleetError
from kvmesh.fleet.config import EngineHandle, EngineKind, FleetConfig, SharedTier, split_args
from kvmesh.fleet.launcher import Fleet, launch
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica, vllm_unavailable_reason

__all__ = [
    "EngineHandle",
    "EngineKind",
    "Fleet",
    "FleetConfig",
    "FleetError",
    "ManagedProcess",
    "SharedTier",
    "VllmReplica",
    "launch",
    "split_args",
    "vllm_unavailable_reason",
]
