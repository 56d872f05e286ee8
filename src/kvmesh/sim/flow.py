"""The router's flow control in virtual time: the live gateway's queue, driven by the event loop.

One :class:`~kvmesh.router.flow_control.FlowController` per gateway (each router replica queues
its own requests) with the router's own :class:`~kvmesh.router.flow_control.SaturationDetector`
asked about that gateway's view of the endpoints. The queue's head is re-checked whenever a
request ends and every ``tick_seconds`` of virtual time while anything is queued (which sees first
tokens and scraped gauges, as the live gateway's tick does); deadlines fire at their exact time.

A request past its deadline fails with ``shed_429`` (the live router's 429), which the report
counts apart from failures and timeouts. The simulated requests carry no tenant or priority: the
tenant is the workload's ``group`` (a shared-prefix group, a multi-turn conversation, an agentic
session; ``""`` when it has none, as trace requests) and every request has priority 0.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.bench.metrics import SHED_ERROR
from kvmesh.router.flow_control import (
    FlowControlConfig,
    FlowController,
    FlowStats,
    SaturationDetector,
    Ticket,
    TicketState,
)
from kvmesh.router.types import EndpointState
from kvmesh.sim.loop import EventLoop
from kvmesh.sim.replica import SimRequest
from kvmesh.sim.routing import SimRouter


class SimFlowControl:
    """Holds simulated requests while every replica is saturated.

    Args:
        config: the router's ``flowControl`` settings.
        router: answers the saturation test and routes what is let through.
        loop: virtual time.
        dispatch: routes a request let through among the given endpoint states of its gateway
            (``req.gateway`` is already chosen).
        done: called with a request that was shed (``failed`` and ``finish`` set).
    """

    def __init__(
        self,
        config: FlowControlConfig,
        router: SimRouter,
        loop: EventLoop,
        dispatch: Callable[[SimRequest, list[EndpointState]], None],
        done: Callable[[SimRequest], None],
    ) -> None:
        self.config = config
        self.router = router
        self.loop = loop
        self._dispatch = dispatch
        self._done = done
        self.detector = SaturationDetector(config)
        self.controllers: list[FlowController[SimRequest]] = [
            FlowController.from_config(config) for _ in router.schedulers
        ]
        self.waits: list[float] = []
        """Seconds queued, per request that waited and was then routed."""
        self._tickets: dict[int, Ticket[SimRequest]] = {}
        self._allowed: list[EndpointState] = []
        """Where the request the last saturation check let through may go."""
        self._ticking = False
        self._draining = False
        self._again = False

    def admit(self, req: SimRequest) -> list[EndpointState] | None:
        """Offer ``req`` to its gateway's queue (``req.gateway`` is chosen here).

        Returns:
            The endpoint states to route it among now, or ``None`` when it was queued (it is
            dispatched later) or shed (already reported done).
        """
        now = self.loop.now
        gateway = req.gateway = self.router.next_gateway()
        ticket = self.controllers[gateway].offer(
            req,
            tenant=req.group or "",
            priority=0,
            now=now,
            fits=self._fits(gateway, now),
            continuing=self.router.continues_cached_work(req, self.config.continuation_share),
        )
        if ticket.state is TicketState.ADMITTED:
            return self._allowed
        if ticket.state is TicketState.SHED:
            self._shed(req, now)
            return None
        self._tickets[req.index] = ticket
        self.loop.call_at(ticket.deadline_s, self._expire)
        if not self._ticking:
            self._ticking = True
            self.loop.call_later(self.config.tick_seconds, self._tick)
        return None

    def remove(self, req: SimRequest) -> None:
        """The client gave up on ``req``: take it out of its queue if it is there."""
        ticket = self._tickets.pop(req.index, None)
        if ticket is not None:
            self.controllers[req.gateway].remove(ticket, self.loop.now)

    def wake(self) -> None:
        """Capacity may have freed: let go every queued request that fits now, in turn."""
        if self._draining:
            self._again = True
            return
        self._draining = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._drain_once()
        finally:
            self._draining = False

    @property
    def num_queued(self) -> int:
        return sum(len(c) for c in self.controllers)

    def stats(self) -> FlowStats:
        """The gateways' counters, summed."""
        total = FlowStats()
        for c in self.controllers:
            for name in FlowStats.__dataclass_fields__:
                setattr(total, name, getattr(total, name) + getattr(c.stats, name))
        return total

    # ------------------------------------------------------------------ internals

    def _fits(self, gateway: int, now: float) -> Callable[[SimRequest], bool]:
        def fits(req: SimRequest) -> bool:
            self._allowed = self.router.admissible(req, gateway, now, self.detector)
            return bool(self._allowed)

        return fits

    def _drain_once(self) -> None:
        now = self.loop.now
        for gateway, ctrl in enumerate(self.controllers):
            if not ctrl:
                continue
            self._shed_expired(ctrl, now)
            fits = self._fits(gateway, now)
            while (ticket := ctrl.next_ready(now, fits)) is not None:
                req = ticket.item
                del self._tickets[req.index]
                self.waits.append(ticket.waited_s)
                self._dispatch(req, self._allowed)

    def _shed_expired(self, ctrl: FlowController[SimRequest], now: float) -> None:
        for ticket in ctrl.expire(now):
            req = ticket.item
            del self._tickets[req.index]
            self._shed(req, now)

    def _shed(self, req: SimRequest, now: float) -> None:
        req.failed = SHED_ERROR
        req.finish = now
        self._done(req)

    def _expire(self) -> None:
        now = self.loop.now
        for ctrl in self.controllers:
            if ctrl:
                self._shed_expired(ctrl, now)

    def _tick(self) -> None:
        self.wake()
        if self.num_queued:
            self.loop.call_later(self.config.tick_seconds, self._tick)
        else:
            self._ticking = False
