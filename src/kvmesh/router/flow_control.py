# Over 450 lines: priority bands, tenants' turns, deadlines and shedding act on one ticket order, and the saturation test beside them is the policy that releases tickets.
"""Flow control: requests wait in the router while every endpoint is saturated.

The core is single-threaded and clock-free: every call takes ``now``, so the live gateway
(:mod:`kvmesh.router.flow_gate`, wall clock) and the fleet simulator (virtual time) drive the same
object. Nothing here sleeps, schedules or knows about HTTP.

::

    offer(item) ──► fits and nothing of its band or higher is queued? ──► ADMITTED
         │                                        no
         ▼
    queue bound reached? ──► SHED (queue_full / tenant_queue_full)
         │ no
         ▼
    band[priority, continuing] ─► tenant rotation ─► FIFO per tenant   (QUEUED)
         │
         ├── next_ready(now, fits): highest band, next tenant in turn, its oldest request,
         │                          if it fits (else nothing: no request overtakes another)
         └── expire(now): past its deadline ──► SHED (deadline)

Fairness: within a priority band, tenants take turns one request at a time (round robin by
request count), so a tenant flooding the queue delays each other tenant by at most one of its own
requests per turn. Arrivals never overtake what is already queued at their priority or above;
a higher-priority arrival that fits goes straight through.

Continuing work first: within a priority, a request that continues work the fleet holds (at least
``continuationShare`` of its prompt cached somewhere: a session's next turn) forms a band above the
others (new sessions, compactions, evicted histories). Under overload those cold prompts are the
ones that wait and meet the deadline; serving them instead would take a session's turn's worth of
GPU time several times over and evict the contexts of the sessions already running.

Saturation (:class:`SaturationDetector`) is asked per request: every healthy endpoint is at
``maxWaitingPerEndpoint`` / ``maxInFlightPerEndpoint`` (when set) or predicts a time to first token
above ``maxPredictedTtftSeconds`` for it (profiles with a ``ttft-estimate-scorer``). A request let
through is routed only among the endpoints within those bounds. Continuing work (see above) is
tested on the work queued ahead of it only, not its own: what makes a session's next turn slow is
the wait for free KV at the endpoint holding its context, which holding the turn in the router does
not shorten, and letting it out only to endpoints under the bound sends it where its context must
be recomputed. The backlog still counts, so continuing work alone cannot pile onto the engines.
Only work the router has dispatched counts toward an endpoint's load (queued requests are in no
ledger and no engine queue), so the estimate falls as endpoints drain and the queue cannot starve itself; an endpoint
with none of this router's requests in flight is never saturated, so an idle endpoint always takes
the head of the queue, however long its prompt.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from kvmesh.errors import ConfigError
from kvmesh.router.types import EndpointState, PrefixMatch, RoutingRequest

if TYPE_CHECKING:
    from kvmesh.router.scheduler import Scheduler

T = TypeVar("T")

DRAIN_WINDOW = 256
"""Dispatches from the queue remembered to estimate its drain rate (for ``Retry-After``)."""


class FlowControlConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """The router's ``flowControl:`` section (camelCase in YAML)."""

    enabled: bool = True
    """Off: every request is routed at once, as without flow control."""
    max_predicted_ttft_seconds: float = 10.0
    """An endpoint whose predicted time to first token for the request is above this is
    saturated (profiles with a ``ttft-estimate-scorer``; 0: this test is off)."""
    require_learned_speed: bool = True
    """Apply the predicted-TTFT test only once the pool's prefill speed has been learned from
    first tokens: the YAML's prior alone can be far off, and non-streamed requests (which teach no
    speed) keep their prefill counted until they end while nothing drains it."""
    max_waiting_per_endpoint: int = 0
    """An endpoint whose scraped ``waiting`` gauge is at least this is saturated (0: off). The
    gauge is one scrape old: pair it with ``maxInFlightPerEndpoint``."""
    max_in_flight_per_endpoint: int = 0
    """An endpoint with this many of the router's requests unfinished is saturated (0: off)."""
    max_queue_wait_seconds: float = 15.0
    """A request queued this long is answered 429 (the header ``x-kvmesh-max-queue-wait-ms`` may
    only lower it). 15 s: under twice the load the simulated agentic fleet serves, 30 s let the
    served p90 reach 3.2-3.5x its 1x value, 15 s 2.7-3.0x (docs/BENCHMARKS.md, "Overload with flow
    control")."""
    max_queued_requests: int = 10_000
    """Requests queued at once; an arrival beyond it is answered 429 at once."""
    per_tenant_max_queued: int = 0
    """Requests one tenant may have queued at once (0: only the global bound)."""
    tick_seconds: float = 0.02
    """How often the gateway re-checks the queue's head besides first tokens and completions."""
    continuation_share: float = 0.9
    """A request whose prompt is at least this share cached somewhere (the index's longest match
    over the endpoints and the shared tier) continues work the fleet holds: while requests wait, it
    goes ahead of the others of its priority, and the predicted-TTFT test counts only the work
    queued ahead of it (0: off).
    Under overload the cold and recomputed prompts wait, and are shed at the deadline, rather than
    the turns of sessions in progress."""

    def __post_init__(self) -> None:
        for name in ("max_predicted_ttft_seconds", "max_queue_wait_seconds"):
            value = getattr(self, name)
            if not value >= 0:
                raise ConfigError(f"flowControl.{_camel(name)} must be >= 0, got {value}")
        for name in (
            "max_waiting_per_endpoint",
            "max_in_flight_per_endpoint",
            "max_queued_requests",
            "per_tenant_max_queued",
        ):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"flowControl.{_camel(name)} must be >= 0, got {value}")
        if not self.tick_seconds > 0:
            raise ConfigError(f"flowControl.tickSeconds must be > 0, got {self.tick_seconds}")
        if not 0.0 <= self.continuation_share <= 1.0:
            raise ConfigError(
                f"flowControl.continuationShare must lie in [0, 1], got {self.continuation_share}"
            )


def continues_cached_work(prefix: PrefixMatch | None, num_tokens: int, share: float) -> bool:
    """Whether at least ``share`` of a ``num_tokens`` prompt is cached somewhere, by ``prefix``
    (``share`` 0, no match or an empty prompt: no)."""
    if share <= 0 or prefix is None or num_tokens <= 0:
        return False
    return prefix.longest_blocks() * prefix.block_size >= share * num_tokens


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


class TicketState(Enum):
    """Where an offered request stands."""

    ADMITTED = "admitted"
    """Went straight to routing."""
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    """Left the queue for routing."""
    SHED = "shed"
    """Refused: see ``Ticket.reason``."""
    REMOVED = "removed"
    """Taken out of the queue by its owner (the client went away)."""


class ShedReason(Enum):
    """Why a request was refused."""

    DEADLINE = "deadline"
    QUEUE_FULL = "queue_full"
    TENANT_QUEUE_FULL = "tenant_queue_full"


@dataclass(slots=True, eq=False)
class Ticket(Generic[T]):
    """One offered request.

    Attributes:
        item: the caller's request object.
        tenant: whose request it is (``""``: none named).
        priority: its band; higher is served first.
        continuing: it continues cached work (``continuationShare``): first within its priority.
        offered_s: when it was offered.
        deadline_s: when it is shed if still queued.
        state: where it stands.
        reason: why it was shed (``None`` unless ``state`` is ``SHED``).
        left_s: when it left the queue (dispatched, shed or removed); ``offered_s`` if it never queued.
    """

    item: T
    tenant: str
    priority: int
    offered_s: float
    deadline_s: float
    seq: int
    state: TicketState = TicketState.QUEUED
    reason: ShedReason | None = None
    left_s: float = -1.0
    continuing: bool = False

    @property
    def rank(self) -> tuple[int, bool]:
        """Its queue band: priority, then continuing cached work first."""
        return (self.priority, self.continuing)

    @property
    def waited_s(self) -> float:
        """Seconds spent queued (0 for a request admitted at once)."""
        return max(self.left_s - self.offered_s, 0.0) if self.left_s >= 0 else 0.0


@dataclass(slots=True)
class _Band:
    """The queued requests of one priority: a FIFO per tenant and the tenants' turn order."""

    queues: dict[str, deque[Ticket[Any]]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)
    num_queued: int = 0


@dataclass(slots=True)
class FlowStats:
    """Counters of one controller since it was made."""

    num_admitted: int = 0
    """Offers that went straight through."""
    num_queued: int = 0
    """Offers that had to wait."""
    num_dispatched: int = 0
    num_shed_deadline: int = 0
    num_shed_full: int = 0
    """Shed at arrival: the queue (or the tenant's share of it) was full."""
    num_removed: int = 0


class FlowController(Generic[T]):
    """Priority bands of per-tenant FIFO queues, taken in turns, with deadlines and bounds.

    Args:
        max_queued: requests queued at once (0: none; every request that does not fit is shed).
        per_tenant_max_queued: requests one tenant may have queued (0: no per-tenant bound).
        max_wait_s: a queued request is shed this long after it was offered.
    """

    def __init__(self, *, max_queued: int, per_tenant_max_queued: int = 0, max_wait_s: float) -> None:
        if max_queued < 0 or per_tenant_max_queued < 0 or not max_wait_s >= 0:
            raise ValueError(
                f"bounds must be >= 0: max_queued={max_queued}, "
                f"per_tenant_max_queued={per_tenant_max_queued}, max_wait_s={max_wait_s}"
            )
        self.max_queued = max_queued
        self.per_tenant_max_queued = per_tenant_max_queued
        self.max_wait_s = max_wait_s
        self.stats = FlowStats()
        self._bands: dict[tuple[int, bool], _Band] = {}
        self._deadlines: list[tuple[float, int, Ticket[T]]] = []
        self._by_tenant: Counter[str] = Counter()
        self._depths: Counter[tuple[str, int]] = Counter()
        self._num_queued = 0
        self._seq = 0
        self._drained: deque[float] = deque(maxlen=DRAIN_WINDOW)

    @classmethod
    def from_config(cls, config: FlowControlConfig) -> FlowController[T]:
        """A controller with ``config``'s bounds."""
        return cls(
            max_queued=config.max_queued_requests,
            per_tenant_max_queued=config.per_tenant_max_queued,
            max_wait_s=config.max_queue_wait_seconds,
        )

    def __len__(self) -> int:
        """Requests queued now."""
        return self._num_queued

    def offer(
        self,
        item: T,
        *,
        tenant: str,
        priority: int,
        now: float,
        fits: Callable[[T], bool],
        max_wait_s: float | None = None,
        continuing: bool = False,
    ) -> Ticket[T]:
        """Admit ``item`` now, queue it, or shed it.

        It is admitted when nothing of its band or higher is queued (no overtaking) and
        ``fits(item)`` says an endpoint can take it; otherwise it is queued, or shed when the queue,
        the tenant's share of it, or its own wait (``max_wait_s`` = 0) leaves no room.

        Args:
            item: the request.
            tenant: its tenant (``""``: none).
            priority: its band; higher first.
            now: the current time.
            fits: whether an endpoint can take a request now (not called when it must queue anyway).
            max_wait_s: the request's own wait limit; only lowers the controller's.
            continuing: it continues cached work; queued ahead of the others of its priority.

        Returns:
            Its ticket: ``ADMITTED``, ``QUEUED`` or ``SHED`` (with the reason).
        """
        wait = self.max_wait_s if max_wait_s is None else min(max(max_wait_s, 0.0), self.max_wait_s)
        self._seq += 1
        ticket = Ticket(item, tenant, priority, now, now + wait, self._seq, continuing=continuing)
        top = self.top_rank()
        if (top is None or top < ticket.rank) and fits(item):
            ticket.state = TicketState.ADMITTED
            ticket.left_s = now
            self.stats.num_admitted += 1
            return ticket
        if self._num_queued >= self.max_queued:
            return self._shed_on_arrival(ticket, ShedReason.QUEUE_FULL, now)
        if self.per_tenant_max_queued and self._by_tenant[tenant] >= self.per_tenant_max_queued:
            return self._shed_on_arrival(ticket, ShedReason.TENANT_QUEUE_FULL, now)
        if wait <= 0:
            return self._shed_on_arrival(ticket, ShedReason.DEADLINE, now)
        band = self._bands.get(ticket.rank)
        if band is None:
            band = self._bands[ticket.rank] = _Band()
        queue = band.queues.get(tenant)
        if queue is None:
            queue = band.queues[tenant] = deque()
        if not queue:
            band.turns.append(tenant)
        queue.append(ticket)
        band.num_queued += 1
        self._count(ticket, +1)
        heapq.heappush(self._deadlines, (ticket.deadline_s, ticket.seq, ticket))
        self.stats.num_queued += 1
        return ticket

    def _shed_on_arrival(self, ticket: Ticket[T], reason: ShedReason, now: float) -> Ticket[T]:
        ticket.state = TicketState.SHED
        ticket.reason = reason
        ticket.left_s = now
        if reason is ShedReason.DEADLINE:
            self.stats.num_shed_deadline += 1
        else:
            self.stats.num_shed_full += 1
        return ticket

    def top_priority(self) -> int | None:
        """The highest priority with a queued request (``None``: the queue is empty)."""
        top = self.top_rank()
        return None if top is None else top[0]

    def top_rank(self) -> tuple[int, bool] | None:
        """The highest band (priority, continuing) with a queued request (``None``: none)."""
        if not self._bands:  # emptied bands are deleted: nothing is queued (every request asks)
            return None
        return max((r for r, band in self._bands.items() if band.num_queued), default=None)

    def next_ready(self, now: float, fits: Callable[[T], bool]) -> Ticket[T] | None:
        """Take the request whose turn it is, if it fits.

        The turn goes to the highest band (priority, then continuing cached work), then to the tenant
        next in that band's rotation, then to
        that tenant's oldest request. When that request does not fit nothing is taken: no request
        overtakes another.

        Args:
            now: the current time.
            fits: whether an endpoint can take this request now.

        Returns:
            The request's ticket (``DISPATCHED``), or ``None``.
        """
        top = self.top_rank()
        if top is None:
            return None
        band = self._bands[top]
        tenant = band.turns[0]
        queue = band.queues[tenant]
        ticket = queue[0]
        assert ticket.state is TicketState.QUEUED, "a ticket left its queue without being popped"
        if not fits(ticket.item):
            return None
        queue.popleft()
        band.turns.popleft()
        if queue:
            band.turns.append(tenant)
        self._leave(band, tenant, ticket, now)
        ticket.state = TicketState.DISPATCHED
        self.stats.num_dispatched += 1
        self._drained.append(now)
        return ticket

    def expire(self, now: float) -> list[Ticket[T]]:
        """Shed every queued request whose deadline has come.

        Returns:
            Their tickets (``SHED``, reason ``DEADLINE``), earliest deadline first.
        """
        out: list[Ticket[T]] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, ticket = heapq.heappop(heap)
            if ticket.state is not TicketState.QUEUED:
                continue
            self._unlink(ticket, now)
            ticket.state = TicketState.SHED
            ticket.reason = ShedReason.DEADLINE
            self.stats.num_shed_deadline += 1
            out.append(ticket)
        return out

    def remove(self, ticket: Ticket[T], now: float) -> bool:
        """Take a queued request out (its client went away).

        Returns:
            ``False`` when it was no longer queued (dispatched or shed meanwhile).
        """
        if ticket.state is not TicketState.QUEUED:
            return False
        self._unlink(ticket, now)
        ticket.state = TicketState.REMOVED
        self.stats.num_removed += 1
        return True

    def queued(self) -> Iterator[Ticket[T]]:
        """Every queued ticket, band by band (highest first), each tenant's in FIFO order."""
        for rank in sorted(self._bands, reverse=True):
            for queue in self._bands[rank].queues.values():
                yield from queue

    def depths(self) -> dict[tuple[str, int], int]:
        """Requests queued per (tenant, priority)."""
        return {k: n for k, n in self._depths.items() if n}

    def drain_rate(self, now: float) -> float:
        """Requests per second leaving the queue for endpoints lately (0: none seen)."""
        drained = self._drained
        if len(drained) < 2:
            return 0.0
        span = max(now, drained[-1]) - drained[0]
        return (len(drained) - 1) / span if span > 0 else 0.0

    def retry_after_s(self, now: float) -> int:
        """Whole seconds after which a refused request has a fair chance: the queue's length over
        its recent drain rate, at least 1, at most the longest wait (1 when that is 0)."""
        ceiling = max(math.ceil(self.max_wait_s), 1)
        rate = self.drain_rate(now)
        if rate <= 0:
            return ceiling if self._num_queued else 1
        return min(max(math.ceil(self._num_queued / rate), 1), ceiling)

    # ------------------------------------------------------------------ internals

    def _unlink(self, ticket: Ticket[T], now: float) -> None:
        band = self._bands[ticket.rank]
        queue = band.queues[ticket.tenant]
        queue.remove(ticket)
        if not queue:
            band.turns.remove(ticket.tenant)
        self._leave(band, ticket.tenant, ticket, now)

    def _leave(self, band: _Band, tenant: str, ticket: Ticket[T], now: float) -> None:
        ticket.left_s = now
        band.num_queued -= 1
        if not band.queues[tenant]:
            del band.queues[tenant]
        if not band.num_queued:
            del self._bands[ticket.rank]
        self._count(ticket, -1)

    def _count(self, ticket: Ticket[T], delta: int) -> None:
        self._num_queued += delta
        self._by_tenant[ticket.tenant] += delta
        if not self._by_tenant[ticket.tenant]:
            del self._by_tenant[ticket.tenant]
        key = (ticket.tenant, ticket.priority)
        self._depths[key] += delta
        if not self._depths[key]:
            del self._depths[key]


class SaturationDetector:
    """Which endpoints can take a request now, by the flow-control config's tests.

    Args:
        config: the thresholds.
    """

    def __init__(self, config: FlowControlConfig) -> None:
        self.config = config

    def admissible(
        self, scheduler: Scheduler, request: RoutingRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        """The healthy endpoints ``request`` may be routed to now; empty when the fleet is saturated.

        Endpoints at ``maxWaitingPerEndpoint`` or ``maxInFlightPerEndpoint`` (those that are set)
        are left out, and so are those whose predicted TTFT for the request is above
        ``maxPredictedTtftSeconds`` (profiles that predict one, once a speed is learned unless
        ``requireLearnedSpeed`` is off; for a request continuing cached work, by
        ``continuationShare``, the work queued ahead of it only). When that leaves none, endpoints
        with none of the router's requests in flight are still admissible: an idle endpoint always
        takes work, however long the prompt. Below saturation, with no load bound set, this is
        every healthy endpoint whose prediction is within the bound (all of them, with the default 10 s).

        Args:
            scheduler: predicts TTFT with its deciding profile (fills ``request.prefix`` when
                ``None``, from its index).
            request: the request.
            endpoints: every endpoint's state; unhealthy ones are ignored.

        Returns:
            The endpoints to route among (the same state objects). No healthy endpoint at all
            gives every endpoint back, so that routing answers it (as without flow control).
        """
        healthy = [e for e in endpoints if e.healthy]
        if not healthy:
            return endpoints
        cfg = self.config
        max_waiting, max_in_flight = cfg.max_waiting_per_endpoint, cfg.max_in_flight_per_endpoint
        room = healthy
        if max_waiting or max_in_flight:
            room = [
                e
                for e in room
                if not (max_waiting and e.waiting >= max_waiting)
                and not (max_in_flight and e.in_flight >= max_in_flight)
            ]
        bound = cfg.max_predicted_ttft_seconds
        if (
            room
            and bound > 0
            and (not cfg.require_learned_speed or any(e.seconds_per_prefill_token > 0 for e in room))
            and not all(e.in_flight == 0 for e in room)  # nothing ahead: its own prefill is no saturation
        ):
            if request.prefix is None:
                request.prefix = scheduler.match(request)
            # a session's next turn is held only for the work queued ahead of it: its own wait (for
            # free KV at its holder, mostly) is as long in the router, and an endpoint under the
            # bound would recompute its context
            continuing = continues_cached_work(request.prefix, request.num_tokens, cfg.continuation_share)
            predicted = scheduler.predicted_ttfts(request, room, work_ahead_only=continuing)
            if predicted is not None:
                room = [e for e in room if predicted.get(e.pod, math.inf) <= bound]
        return room or [e for e in healthy if e.in_flight == 0]

    def saturated(
        self, scheduler: Scheduler, request: RoutingRequest, endpoints: list[EndpointState]
    ) -> bool:
        """``True`` when healthy endpoints exist and none is admissible for ``request`` (see
        :meth:`admissible`); no healthy endpoint is routing's answer, not a reason to wait."""
        return any(e.healthy for e in endpoints) and not self.admissible(scheduler, request, endpoints)
