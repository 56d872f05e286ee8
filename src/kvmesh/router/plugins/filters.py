"""Filters: drop endpoints that must not serve a request."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.tenancy import Role
from kvmesh.router.plugins.base import Filter, Params, PluginContext
from kvmesh.router.types import EndpointState, RoutingRequest


@dataclass(slots=True)
class RoleFilter:
    """Keeps endpoints serving ``role`` (endpoints with role ``both`` serve every role)."""

    role: Role

    def filter(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        role = self.role
        return [e for e in endpoints if e.role is role or e.role is Role.BOTH]


@dataclass(slots=True)
class QueueDepthFilter:
    """Drops endpoints whose queue exceeds ``max_waiting``, unless that would drop them all."""

    max_waiting: int

    def filter(self, request: RoutingRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        kept = [e for e in endpoints if e.waiting <= self.max_waiting]
        return kept or endpoints


def make_prefill_filter(name: str, params: Params, ctx: PluginContext) -> RoleFilter:
    return RoleFilter(Role.PREFILL)


def make_decode_filter(name: str, params: Params, ctx: PluginContext) -> RoleFilter:
    return RoleFilter(Role.DECODE)


def make_queue_depth_filter(name: str, params: Params, ctx: PluginContext) -> QueueDepthFilter:
    return QueueDepthFilter(params.integer("maxWaiting", 32, minimum=0))


def _conforms(a: RoleFilter, b: QueueDepthFilter) -> tuple[Filter, Filter]:
    return a, b
