"""The flow-control core: turn order, priorities, deadlines, bounds and the saturation test."""

from __future__ import annotations

import random

import pytest

from kvmesh.core.hashing import Namespace
from kvmesh.core.types import Medium
from kvmesh.errors import ConfigError
from kvmesh.router.flow_control import (
    FlowControlConfig,
    FlowController,
    SaturationDetector,
    ShedReason,
    Ticket,
    TicketState,
    continues_cached_work,
)
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.plugins.ttft_estimate import TTFTEstimateScorer
from kvmesh.router.scheduler import Scheduler, load_scheduler_config
from kvmesh.router.types import EndpointState, PodMatch, PrefixMatch, RoutingRequest


def never(item: object) -> bool:
    return False


def always(item: object) -> bool:
    return True


def controller(**kwargs: object) -> FlowController[str]:
    args: dict[str, object] = {"max_queued": 1000, "max_wait_s": 30.0}
    args.update(kwargs)
    return FlowController(**args)  # type: ignore[arg-type]


def drain(ctrl: FlowController[str], now: float = 1.0) -> list[str]:
    out = []
    while (t := ctrl.next_ready(now, always)) is not None:
        out.append(t.item)
    return out


def test_admitted_at_once_while_it_fits_and_nothing_waits():
    ctrl = controller()
    t = ctrl.offer("a", tenant="x", priority=0, now=0.0, fits=always)
    assert t.state is TicketState.ADMITTED and t.waited_s == 0.0 and len(ctrl) == 0
    assert ctrl.stats.num_admitted == 1


def test_a_flooding_tenant_cannot_starve_another():
    ctrl = controller()
    for i in range(100):
        ctrl.offer(f"A{i}", tenant="A", priority=0, now=0.0, fits=never)
    for i in range(5):
        ctrl.offer(f"B{i}", tenant="B", priority=0, now=0.0, fits=never)
    order = drain(ctrl)
    assert order[:10] == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3", "A4", "B4"]
    assert order[10:] == [f"A{i}" for i in range(5, 100)]


def test_a_tenant_arriving_later_gets_the_next_turn():
    ctrl = controller()
    for i in range(10):
        ctrl.offer(f"A{i}", tenant="A", priority=0, now=0.0, fits=never)
    assert drain_n(ctrl, 3) == ["A0", "A1", "A2"]
    ctrl.offer("B0", tenant="B", priority=0, now=1.0, fits=always)  # queues: no overtaking
    ctrl.offer("C0", tenant="C", priority=0, now=1.0, fits=always)
    assert drain_n(ctrl, 4) == ["A3", "B0", "C0", "A4"]


def drain_n(ctrl: FlowController[str], n: int) -> list[str]:
    out = []
    for _ in range(n):
        t = ctrl.next_ready(1.0, always)
        assert t is not None and t.state is TicketState.DISPATCHED
        out.append(t.item)
    return out


def test_fifo_within_a_tenant_and_no_overtaking_while_the_head_does_not_fit():
    ctrl = controller()
    for i in range(3):
        ctrl.offer(f"A{i}", tenant="A", priority=0, now=float(i), fits=never)
    assert ctrl.next_ready(5.0, lambda item: item != "A0") is None  # A1 fits but A0 is first
    assert ctrl.offer("A3", tenant="A", priority=0, now=5.0, fits=always).state is TicketState.QUEUED
    assert drain(ctrl) == ["A0", "A1", "A2", "A3"]


def test_higher_priority_first_and_may_go_straight_through():
    ctrl = controller()
    for i in range(3):
        ctrl.offer(f"lo{i}", tenant="A", priority=0, now=0.0, fits=never)
    ctrl.offer("mid", tenant="B", priority=5, now=0.0, fits=never)
    # higher than anything queued and it fits: no need to wait behind lower priorities
    assert ctrl.offer("hi", tenant="C", priority=9, now=0.0, fits=always).state is TicketState.ADMITTED
    # equal to the highest queued: waits behind it
    assert ctrl.offer("mid2", tenant="C", priority=5, now=0.0, fits=always).state is TicketState.QUEUED
    assert ctrl.top_priority() == 5
    assert ctrl.depths() == {("A", 0): 3, ("B", 5): 1, ("C", 5): 1}
    assert drain(ctrl) == ["mid", "mid2", "lo0", "lo1", "lo2"]
    assert ctrl.top_priority() is None and ctrl.depths() == {}


def test_within_a_priority_work_the_fleet_holds_goes_first():
    ctrl = controller()
    ctrl.offer("cold0", tenant="A", priority=0, now=0.0, fits=never)
    ctrl.offer("warm0", tenant="A", priority=0, now=0.0, fits=never, continuing=True)
    ctrl.offer("cold1", tenant="B", priority=0, now=0.0, fits=never)
    ctrl.offer("urgent", tenant="B", priority=1, now=0.0, fits=never)
    # a continuing arrival that fits overtakes the cold ones queued at its priority...
    assert ctrl.offer("warm1", tenant="C", priority=0, now=0.0, fits=always, continuing=True).state is (
        TicketState.QUEUED  # ...but not the continuing one already waiting, nor a higher priority
    )
    assert ctrl.top_priority() == 1 and ctrl.top_rank() == (1, False)
    assert ctrl.depths() == {("A", 0): 2, ("B", 0): 1, ("B", 1): 1, ("C", 0): 1}
    assert drain(ctrl) == ["urgent", "warm0", "warm1", "cold0", "cold1"]
    # with only cold requests queued, a continuing one that fits goes straight through
    ctrl.offer("cold2", tenant="A", priority=0, now=2.0, fits=never)
    assert ctrl.offer("warm2", tenant="B", priority=0, now=2.0, fits=always, continuing=True).state is (
        TicketState.ADMITTED
    )
    assert ctrl.offer("cold3", tenant="B", priority=0, now=2.0, fits=always).state is TicketState.QUEUED


def test_continuing_work_is_a_share_of_the_prompt_cached_somewhere():
    match = PrefixMatch(10, 16, pods={"a": PodMatch(6), "b": PodMatch(9)})
    assert continues_cached_work(match, 160, 0.9)  # b holds 144 of 160 tokens
    assert not continues_cached_work(match, 161, 0.9)
    assert not continues_cached_work(match, 160, 0.0)  # off
    assert not continues_cached_work(None, 160, 0.9) and not continues_cached_work(match, 0, 0.9)
    shared = PrefixMatch(10, 16, shared=PodMatch(10))
    assert continues_cached_work(shared, 160, 1.0)  # the shared tier counts for every endpoint


def test_deadlines_shed_in_order_and_a_request_may_only_lower_its_own():
    ctrl = controller(max_wait_s=10.0)
    a = ctrl.offer("a", tenant="A", priority=0, now=0.0, fits=never)
    b = ctrl.offer("b", tenant="B", priority=0, now=1.0, fits=never, max_wait_s=2.0)
    c = ctrl.offer("c", tenant="C", priority=0, now=2.0, fits=never, max_wait_s=60.0)
    assert (a.deadline_s, b.deadline_s, c.deadline_s) == (10.0, 3.0, 12.0)
    assert ctrl.expire(2.9) == []
    assert ctrl.expire(3.0) == [b]
    assert b.state is TicketState.SHED and b.reason is ShedReason.DEADLINE and b.waited_s == 2.0
    assert [t.item for t in ctrl.expire(20.0)] == ["a", "c"]
    assert len(ctrl) == 0 and ctrl.stats.num_shed_deadline == 3


def test_zero_wait_is_never_queued():
    ctrl = controller()
    t = ctrl.offer("a", tenant="A", priority=0, now=0.0, fits=never, max_wait_s=0.0)
    assert t.state is TicketState.SHED and t.reason is ShedReason.DEADLINE and len(ctrl) == 0


def test_queue_bounds_shed_on_arrival():
    ctrl = controller(max_queued=4, per_tenant_max_queued=3)
    states = [ctrl.offer(f"A{i}", tenant="A", priority=0, now=0.0, fits=never) for i in range(4)]
    assert [t.state for t in states] == [TicketState.QUEUED] * 3 + [TicketState.SHED]
    assert states[3].reason is ShedReason.TENANT_QUEUE_FULL
    assert ctrl.offer("B0", tenant="B", priority=0, now=0.0, fits=never).state is TicketState.QUEUED
    full = ctrl.offer("C0", tenant="C", priority=0, now=0.0, fits=never)
    assert full.state is TicketState.SHED and full.reason is ShedReason.QUEUE_FULL
    assert ctrl.stats.num_shed_full == 2 and len(ctrl) == 4


def test_removed_requests_leave_every_count():
    ctrl = controller()
    tickets = [ctrl.offer(f"A{i}", tenant="A", priority=0, now=0.0, fits=never) for i in range(3)]
    assert ctrl.remove(tickets[1], 1.0) is True
    assert ctrl.remove(tickets[1], 1.0) is False
    assert tickets[1].state is TicketState.REMOVED and tickets[1].waited_s == 1.0
    assert ctrl.depths() == {("A", 0): 2}
    assert ctrl.expire(100.0) == tickets[::2]  # the removed one is not shed again
    assert len(ctrl) == 0 and ctrl.depths() == {}


def test_retry_after_follows_the_drain_rate():
    ctrl = controller(max_wait_s=30.0)
    assert ctrl.retry_after_s(0.0) == 1
    for i in range(40):
        ctrl.offer(f"A{i}", tenant="A", priority=0, now=0.0, fits=never)
    assert ctrl.retry_after_s(0.0) == 30  # queued, never drained: the longest wait
    for k in range(11):  # 10 per second
        assert ctrl.next_ready(k * 0.1, always) is not None
    assert ctrl.drain_rate(1.0) == pytest.approx(10.0)
    assert ctrl.retry_after_s(1.0) == 3  # 29 queued at 10/s


def test_randomized_invariants():
    rng = random.Random(3)
    ctrl: FlowController[int] = FlowController(max_queued=50, per_tenant_max_queued=20, max_wait_s=5.0)
    now = 0.0
    live: dict[int, Ticket[int]] = {}
    for i in range(5000):
        now += rng.random() * 0.05
        op = rng.random()
        if op < 0.5:
            t = ctrl.offer(
                i,
                tenant=rng.choice("ABCD"),
                priority=rng.randrange(3),
                now=now,
                fits=lambda x: rng.random() < 0.2,
            )
            if t.state is TicketState.QUEUED:
                live[i] = t
        elif op < 0.8:
            t2 = ctrl.next_ready(now, lambda x: rng.random() < 0.7)
            if t2 is not None:
                top = max([t2.priority] + [q.priority for q in ctrl.queued()])
                assert t2.priority == top
                del live[t2.item]
        elif op < 0.95:
            for t3 in ctrl.expire(now):
                assert t3.deadline_s <= now
                del live[t3.item]
        elif live:
            victim = rng.choice(list(live))
            assert ctrl.remove(live.pop(victim), now)
        assert len(ctrl) == len(live) == sum(ctrl.depths().values()) <= 50
        assert {t.item for t in ctrl.queued()} == set(live)


def test_config_defaults_and_validation():
    cfg = FlowControlConfig()
    assert cfg.enabled and cfg.max_predicted_ttft_seconds == 10.0 and cfg.max_queue_wait_seconds == 15.0
    with pytest.raises(ConfigError, match="maxQueuedRequests"):
        FlowControlConfig(max_queued_requests=-1)
    with pytest.raises(ConfigError, match="tickSeconds"):
        FlowControlConfig(tick_seconds=0)
    assert cfg.continuation_share == 0.9
    with pytest.raises(ConfigError, match="continuationShare"):
        FlowControlConfig(continuation_share=1.5)


# --- saturation ------------------------------------------------------------------------------------


def scheduler(policy: str) -> Scheduler:
    return Scheduler.from_config(
        load_scheduler_config(policy), index=InMemoryIndex(), block_size=16, rng=random.Random(0)
    )


def request(num_tokens: int = 160) -> RoutingRequest:
    return RoutingRequest("r", list(range(num_tokens)), Namespace("m"))


def busy(pod: str, pending: int, **kwargs: object) -> EndpointState:
    state = EndpointState(pod, in_flight=1, pending_prefill_tokens=pending, **kwargs)  # type: ignore[arg-type]
    state.seconds_per_prefill_token = 1 / 8000
    return state


def test_predicted_ttfts_are_the_profile_estimates_per_endpoint():
    sched = scheduler("precise")
    states = [busy("a", 80_000), busy("b", 16_000), EndpointState("c", healthy=False)]
    req = request(160)
    predicted = sched.predicted_ttfts(req, states)
    (estimator,) = [
        w.scorer for w in sched.profiles["default"].scorers if isinstance(w.scorer, TTFTEstimateScorer)
    ]
    assert predicted == {"a": estimator.estimate(req, states[0]), "b": estimator.estimate(req, states[1])}
    assert predicted["b"] == pytest.approx((16_000 + 160) / 8000, rel=0.01)
    assert predicted["b"] < predicted["a"]
    assert scheduler("load").predicted_ttfts(request(), states) is None


def test_saturated_when_every_endpoint_predicts_above_the_bound():
    detector = SaturationDetector(FlowControlConfig(max_predicted_ttft_seconds=1.0))
    sched = scheduler("precise")
    assert detector.saturated(sched, request(), [busy("a", 9000), busy("b", 9000)])
    assert not detector.saturated(sched, request(), [busy("a", 9000), busy("b", 7000)])
    # an endpoint with nothing of ours in flight always takes work, however long the prompt
    assert not detector.saturated(sched, request(100_000), [busy("a", 9000), EndpointState("b")])
    assert not detector.saturated(sched, request(), [])


def test_continuing_work_is_not_held_for_a_wait_for_free_kv():
    def kv_full(pod: str, pending: int = 0) -> EndpointState:
        # 10 of 10,000 KV tokens free, released at 100 tokens/s: a 160-token prompt waits 1.5 s
        state = busy(pod, pending, kv_capacity_tokens=10_000, kv_cache_usage=0.999)
        state.kv_release_tokens_per_s = 100.0
        return state

    detector = SaturationDetector(FlowControlConfig(max_predicted_ttft_seconds=1.0))
    sched = scheduler("precise")

    def turn() -> RoutingRequest:  # a session's next turn: all 160 tokens cached on a
        r = request(160)
        r.prefix = PrefixMatch(10, 16, {"a": PodMatch(10, {Medium.GPU: 10})})
        return r

    full = [kv_full("a"), kv_full("b")]
    assert detector.admissible(sched, turn(), full) == full
    cold = request(160)
    cold.prefix = PrefixMatch(10, 16, {"a": PodMatch(2, {Medium.GPU: 2})})  # 20 % cached
    assert detector.saturated(sched, cold, full)
    # its compute backlog still counts: continuing work alone cannot pile onto the engines
    assert detector.saturated(sched, turn(), [kv_full("a", 9000), kv_full("b", 9000)])
    # with continuing work first turned off, the wait for KV holds it too
    off = SaturationDetector(FlowControlConfig(max_predicted_ttft_seconds=1.0, continuation_share=0.0))
    assert off.saturated(sched, turn(), full)


def test_the_prior_alone_does_not_saturate_unless_allowed():
    states = [busy("a", 90_000), busy("b", 90_000)]
    for s in states:
        s.seconds_per_prefill_token = 0.0  # nothing learned yet
    strict = SaturationDetector(FlowControlConfig(max_predicted_ttft_seconds=1.0))
    trusting = SaturationDetector(
        FlowControlConfig(max_predicted_ttft_seconds=1.0, require_learned_speed=False)
    )
    assert not strict.saturated(scheduler("precise"), request(), states)
    assert trusting.saturated(scheduler("precise"), request(), states)


def test_load_criterion_for_profiles_without_a_ttft_estimate():
    sched = scheduler("load")
    off = SaturationDetector(FlowControlConfig())
    by_flight = SaturationDetector(FlowControlConfig(max_in_flight_per_endpoint=4))
    by_waiting = SaturationDetector(FlowControlConfig(max_waiting_per_endpoint=2))
    full = [EndpointState("a", in_flight=4, waiting=2), EndpointState("b", in_flight=5, waiting=3)]
    assert not off.saturated(sched, request(), full)
    assert by_flight.saturated(sched, request(), full)
    assert by_waiting.saturated(sched, request(), full)
    one_free = [EndpointState("a", in_flight=4, waiting=2), EndpointState("b", in_flight=3, waiting=1)]
    assert not by_flight.saturated(sched, request(), one_free)
    assert not by_waiting.saturated(sched, request(), one_free)


def test_admissible_endpoints_are_those_below_the_bounds_or_idle():
    sched = scheduler("load")
    detector = SaturationDetector(FlowControlConfig(max_in_flight_per_endpoint=4))
    a, b, c = (
        EndpointState("a", in_flight=4),
        EndpointState("b", in_flight=2),
        EndpointState("c", in_flight=9),
    )
    assert detector.admissible(sched, request(), [a, b, c]) == [b]
    b.in_flight = 4
    assert detector.admissible(sched, request(), [a, b, c]) == []
    # with no bound set (the default), routing sees every healthy endpoint
    plain = SaturationDetector(FlowControlConfig())
    assert plain.admissible(sched, request(), [a, b, c, EndpointState("d", healthy=False)]) == [a, b, c]
    # past the TTFT bound only idle endpoints take work
    ttft = SaturationDetector(FlowControlConfig(max_predicted_ttft_seconds=1.0))
    busy_a, idle = busy("a", 90_000), EndpointState("b", seconds_per_prefill_token=1 / 8000)
    assert ttft.admissible(scheduler("precise"), request(20_000), [busy_a, idle]) == [idle]
    # within the bound are routed among; an endpoint predicted above it is left out
    busy_b = busy("c", 4_000)
    assert ttft.admissible(scheduler("precise"), request(), [busy_a, idle, busy_b]) == [idle, busy_b]
