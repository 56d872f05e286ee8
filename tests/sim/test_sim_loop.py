import pytest

from kvmesh.sim.loop import EventLoop
from kvmesh.sim.network import Link, gbps_to_bytes_per_s, path_transfer


def test_events_run_in_time_order_and_ties_in_insertion_order():
    loop = EventLoop()
    seen = []
    loop.call_at(2.0, seen.append, "c")
    loop.call_at(1.0, seen.append, "a")
    loop.call_at(1.0, seen.append, "b")
    loop.call_later(0.5, seen.append, "first")
    loop.run()
    assert seen == ["first", "a", "b", "c"]
    assert loop.now == 2.0
    assert loop.num_events == 4


def test_callbacks_schedule_more_events_and_until_stops_the_clock():
    loop = EventLoop()
    ticks = []

    def tick() -> None:
        ticks.append(loop.now)
        loop.call_later(1.0, tick)

    loop.call_at(0.0, tick)
    loop.run(until=3.5)
    assert ticks == [0.0, 1.0, 2.0, 3.0]
    assert loop.now == 3.5
    assert len(loop) == 1  # the 4.0 tick is still pending


def test_scheduling_in_the_past_is_refused():
    loop = EventLoop()
    loop.call_at(5.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match=r"already at 5\.0"):
        loop.call_at(4.0, lambda: None)


def test_link_queues_transfers_fifo_and_adds_latency():
    link = Link(bytes_per_s=1000.0, latency_s=0.5)
    assert link.transfer(0.0, 1000) == 1.5  # 1 s on the wire + latency
    assert link.transfer(0.2, 500) == 2.0  # waits for the first to leave the wire at 1.0
    assert link.num_bytes == 1500 and link.num_transfers == 2
    assert link.busy_s == pytest.approx(1.5)
    assert link.transfer(10.0, 0) == 10.0  # nothing to send


def test_path_transfer_lands_when_the_slowest_link_is_through():
    store = Link(4000.0, 0.0)
    nic_a, nic_b = Link(1000.0, 0.2), Link(1000.0, 0.2)
    # two replicas pull at once: the 4x faster store NIC serves both, each replica NIC takes 2 s
    assert path_transfer(0.0, 2000, store, nic_a) == pytest.approx(2.2)
    assert path_transfer(0.0, 2000, store, nic_b) == pytest.approx(2.2)
    assert store.busy_until == pytest.approx(1.0)
    # a slow store NIC is the queue
    slow_store = Link(500.0)
    assert path_transfer(0.0, 1000, slow_store, Link(1000.0)) == pytest.approx(2.0)
    assert path_transfer(0.0, 1000, slow_store, Link(1000.0)) == pytest.approx(4.0)
    assert gbps_to_bytes_per_s(8.0) == 1e9


def test_link_rejects_bad_parameters():
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0)
    with pytest.raises(ValueError, match="latency"):
        Link(1.0, -1.0)
