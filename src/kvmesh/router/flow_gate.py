"""Flow control in the live gateway: the asyncio edge around :class:`FlowController`.

A request that finds every endpoint saturated parks on a future until its turn comes and an
endpoint can take it, or until its deadline (then 429 with ``Retry-After``). The queue's head is
re-checked when a routed request gets its first token or ends (:meth:`FlowGate.wake`, called by
the proxy) and every ``tickSeconds`` (which also sees scraped gauges change and finds clients that
went away while queued).

Queued requests leave one at a time: the next is let go only once the previous one has been
routed (:meth:`FlowGate.release`), so each check sees the endpoint load of every request let go
before it (the proxy counts a request on its endpoint before its first await).

Headers: ``x-kvmesh-priority`` (integer, higher first; default 0), ``x-kvmesh-max-queue-wait-ms``
(lowers the configured deadline for this request; 0: never queue), and on every answer while flow
control is on, ``x-kvmesh-queue-wait-ms`` (time spent queued).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from kvmesh.core.tasks import cancel_and_wait
from kvmesh.errors import RequestError, TierUnavailableError
from kvmesh.router.client_request import ClientRequest
from kvmesh.router.flow_control import (
    FlowControlConfig,
    FlowController,
    SaturationDetector,
    ShedReason,
    Ticket,
    TicketState,
    continues_cached_work,
)
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.prefill_ledger import PrefillLedger
from kvmesh.router.replies import error_response
from kvmesh.router.scheduler import Scheduler
from kvmesh.router.types import EndpointState, RoutingRequest

PRIORITY_HEADER = "x-kvmesh-priority"
"""Request header: the request's priority band, an integer; higher is served first."""
MAX_QUEUE_WAIT_HEADER = "x-kvmesh-max-queue-wait-ms"
"""Request header: milliseconds the request may wait queued (only lowers ``maxQueueWaitSeconds``)."""
QUEUE_WAIT_HEADER = "x-kvmesh-queue-wait-ms"
"""Response header: milliseconds the request spent in the flow-control queue."""
DISCONNECT_SWEEP_S = 0.25
"""How often queued requests are checked for clients that went away."""
_MAX_PRIORITY = 1 << 31


def parse_flow_headers(headers: Mapping[str, str]) -> tuple[int, float | None]:
    """The request's priority and its own queue-wait limit (seconds; ``None``: the configured one).

    Raises:
        RequestError: a header is not an integer in range.
    """
    priority = _int_header(headers, PRIORITY_HEADER) or 0
    if abs(priority) >= _MAX_PRIORITY:
        raise RequestError(f"{PRIORITY_HEADER} must lie in (-2^31, 2^31), got {priority}")
    max_wait_s: float | None = None
    ms = _int_header(headers, MAX_QUEUE_WAIT_HEADER)
    if ms is not None:
        if ms < 0:
            raise RequestError(f"{MAX_QUEUE_WAIT_HEADER} must be >= 0, got {ms}")
        max_wait_s = ms / 1000.0
    return priority, max_wait_s


def _int_header(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise RequestError(f"{name} must be an integer, got {raw!r}") from None


@dataclass(slots=True, eq=False)
class _Waiter:
    """A request in the gate: what the saturation test reads and how its handler is woken."""

    routing: RoutingRequest
    request: ClientRequest | None = None
    future: asyncio.Future[None] | None = None
    in_transit: bool = False
    """Let go from the queue and not yet routed."""
    endpoints: list[EndpointState] | None = None
    """Where it may be routed, as the last saturation check found (``None``: not checked)."""


class FlowGate:
    """Holds requests while every endpoint is saturated, fair across tenants, by priority.

    Args:
        config: the ``flowControl`` section.
        scheduler: answers the saturation test (its deciding profile's TTFT estimate).
        ledger: the prefill work sent to each endpoint; refreshed before each check.
        metrics: where queueing and shedding are counted.
        clock: seconds counter.
    """

    def __init__(
        self,
        config: FlowControlConfig,
        scheduler: Scheduler,
        ledger: PrefillLedger,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.ledger = ledger
        self.metrics = metrics
        self.clock = clock
        self.controller: FlowController[_Waiter] = FlowController.from_config(config)
        self.detector = SaturationDetector(config)
        self.closed = False
        self._states: Callable[[], list[EndpointState]] = list
        self._in_transit = 0
        self._drain_scheduled = False
        self._queued = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        metrics.watch_flow(self.controller.depths)

    # ------------------------------------------------------------------ lifecycle

    def start(self, states: Callable[[], list[EndpointState]]) -> None:
        """Begin checking the queue periodically, against the endpoints ``states`` returns."""
        self._states = states
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick_loop())

    async def aclose(self) -> None:
        """Stop the periodic check; queued requests are let go with ``REMOVED`` tickets."""
        self.closed = True
        await cancel_and_wait([self._task])
        self._task = None
        now = self.clock()
        for ticket in list(self.controller.queued()):
            self.controller.remove(ticket, now)
            self._resolve(ticket)

    # ------------------------------------------------------------------ requests

    def _continues_cached_work(self, routing: RoutingRequest) -> bool:
        """Whether ``continuationShare`` of the prompt is cached somewhere; matches the prefix
        (kept on ``routing`` for routing) unless the gateway matched it already."""
        share = self.config.continuation_share
        if share <= 0:
            return False
        if routing.prefix is None:
            try:
                routing.prefix = self.scheduler.match(routing)
            except TierUnavailableError:
                return False
        return continues_cached_work(routing.prefix, routing.num_tokens, share)

    async def admit(
        self,
        routing: RoutingRequest,
        *,
        tenant: str,
        priority: int,
        max_wait_s: float | None,
        request: ClientRequest | None = None,
    ) -> Ticket[_Waiter]:
        """Let ``routing`` through now, after a wait in the queue, or not at all.

        Route an ``ADMITTED`` or ``DISPATCHED`` request among :meth:`endpoints_for` it, then call
        :meth:`release` (also when routing failed).

        Args:
            routing: the request (``prefix`` set already when the index is remote).
            tenant: its tenant (``""``: none).
            priority: its band; higher first.
            max_wait_s: its own queue-wait limit (``None``: the configured one).
            request: the client's HTTP request, whose connection is watched while queued.

        Returns:
            The ticket: ``ADMITTED`` or ``DISPATCHED`` (route it), ``SHED`` (answer
            :meth:`shed_response`), or ``REMOVED`` (the client went away, or the gate closed).
        """
        now = self.clock()
        self._expire(now)
        self.ledger.refresh(now)
        waiter = _Waiter(routing, request)
        ticket = self.controller.offer(
            waiter,
            tenant=tenant,
            priority=priority,
            now=now,
            fits=self._fits,
            max_wait_s=max_wait_s,
            continuing=self._continues_cached_work(routing),
        )
        if ticket.state is TicketState.SHED:
            self._count_shed(ticket)
            return ticket
        if ticket.state is not TicketState.QUEUED:
            return ticket
        self.metrics.flow_queued.inc()
        future = waiter.future = asyncio.get_running_loop().create_future()
        self._queued.set()
        try:
            await future
        except asyncio.CancelledError:
            if self.controller.remove(ticket, self.clock()):
                self.metrics.flow_wait_seconds.labels("cancelled").observe(ticket.waited_s)
            else:
                self.release(ticket)
            raise
        return ticket

    def endpoints_for(self, ticket: Ticket[_Waiter], states: list[EndpointState]) -> list[EndpointState]:
        """The endpoints a request let through may be routed to: those below the load bounds
        (or an idle one) when it was let through, else ``states``."""
        allowed = ticket.item.endpoints
        return states if allowed is None else allowed

    def release(self, ticket: Ticket[_Waiter]) -> None:
        """The request of ``ticket`` was routed: the queue's next request may be checked."""
        waiter = ticket.item
        if waiter.in_transit:
            waiter.in_transit = False
            self._in_transit -= 1
            self.wake()

    def wake(self) -> None:
        """Capacity may have freed (a first token, a finished request): re-check the queue soon."""
        if self.controller and not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def shed_response(self, ticket: Ticket[_Waiter]) -> web.Response:
        """The 429 for a shed request: OpenAI's error shape, ``Retry-After`` and the wait header."""
        retry = self.controller.retry_after_s(self.clock())
        cfg = self.config
        reason = ticket.reason
        if reason is ShedReason.TENANT_QUEUE_FULL:
            kind = "rate_limit_exceeded"
            message = (
                f"tenant {ticket.tenant!r} already has {cfg.per_tenant_max_queued} requests waiting "
                f"for capacity; retry after {retry} s"
            )
        elif reason is ShedReason.QUEUE_FULL:
            kind = "overloaded"
            message = (
                f"every endpoint is saturated and {cfg.max_queued_requests} requests are already "
                f"waiting; retry after {retry} s"
            )
        else:
            kind = "overloaded"
            limit = ticket.deadline_s - ticket.offered_s
            message = (
                f"every endpoint stayed saturated for the {limit:.3g} s this request may wait "
                f"(waited {ticket.waited_s:.3g} s); retry after {retry} s"
            )
        resp = error_response(429, message, kind=kind)
        resp.headers["Retry-After"] = str(retry)
        resp.headers[QUEUE_WAIT_HEADER] = wait_ms(ticket)
        return resp

    # ------------------------------------------------------------------ internals

    def _fits(self, waiter: _Waiter) -> bool:
        if self._in_transit:
            return False
        states = self._states()
        try:
            allowed = self.detector.admissible(self.scheduler, waiter.routing, states)
        except TierUnavailableError:
            allowed = states  # routing falls back to load; waiting would not bring the index back
        waiter.endpoints = allowed
        # no healthy endpoint at all is routing's answer (503), not a reason to wait
        return bool(allowed) or not any(e.healthy for e in states)

    def _drain(self) -> None:
        self._drain_scheduled = False
        if not self.controller:
            return
        now = self.clock()
        self._expire(now)
        self.ledger.refresh(now)
        ticket = self.controller.next_ready(now, self._fits)
        if ticket is None:
            return
        ticket.item.in_transit = True
        self._in_transit += 1
        self.metrics.flow_wait_seconds.labels("dispatched").observe(ticket.waited_s)
        self._resolve(ticket)

    def _expire(self, now: float) -> None:
        if not self.controller:
            return
        for ticket in self.controller.expire(now):
            self._count_shed(ticket)
            self.metrics.flow_wait_seconds.labels("shed").observe(ticket.waited_s)
            self._resolve(ticket)

    def _sweep_disconnected(self, now: float) -> None:
        for ticket in [t for t in self.controller.queued() if _client_gone(t.item.request)]:
            self.controller.remove(ticket, now)
            self.metrics.flow_wait_seconds.labels("cancelled").observe(ticket.waited_s)
            self._resolve(ticket)

    def _count_shed(self, ticket: Ticket[_Waiter]) -> None:
        assert ticket.reason is not None, "a shed ticket without a reason"
        self.metrics.flow_shed.labels(ticket.reason.value).inc()

    @staticmethod
    def _resolve(ticket: Ticket[_Waiter]) -> None:
        future = ticket.item.future
        if future is not None and not future.done():
            future.set_result(None)

    async def _tick_loop(self) -> None:
        last_sweep = self.clock()
        while True:
            if not self.controller:
                self._queued.clear()
                await self._queued.wait()
            await asyncio.sleep(self.config.tick_seconds)
            now = self.clock()
            if now - last_sweep >= DISCONNECT_SWEEP_S:
                last_sweep = now
                self._sweep_disconnected(now)
            self._drain()


def wait_ms(ticket: Ticket[_Waiter] | None) -> str:
    """The ``x-kvmesh-queue-wait-ms`` value of a request (``"0"`` when it did not wait)."""
    return "0" if ticket is None else str(round(ticket.waited_s * 1000))


def _client_gone(request: ClientRequest | None) -> bool:
    if request is None:
        return False
    transport = request.transport
    return transport is None or transport.is_closing()
