"""request_tracker: load plans (block alignment, last token, partial hits) and save plans."""

from __future__ import annotations

import pytest

from kvmesh.core.hashing import Namespace
from kvmesh.core.shared_writes import PromptBlocks
from kvmesh.integrations.request_tracker import LoadSpec, RequestTracker, SaveSpec, num_loadable_tokens

NS = Namespace("m", kv_dtype="bfloat16", kv_layout="L3xH2xD8")


@pytest.mark.parametrize(
    ("prompt_len", "num_computed", "num_stored", "block_size", "expected"),
    [
        (100, 0, 64, 16, 64),  # hit inside the prompt
        (64, 0, 64, 16, 48),  # the whole prompt stored: the last token is recomputed, whole blocks only
        (65, 0, 64, 16, 64),  # one token past the hit: all of it loads
        (100, 32, 64, 16, 32),  # local prefix cache already has 32
        (100, 64, 64, 16, 0),  # local hit covers the store's
        (100, 80, 64, 16, 0),  # local hit beyond the store's
        (100, 0, 0, 16, 0),  # miss
        (100, 0, 96, 32, 96),  # engine blocks of 32
        (90, 0, 96, 32, 64),  # stored more than the prompt minus one: floored to a block
        (1, 0, 0, 16, 0),
        (70, 0, 64, 24, 48),  # block size that does not divide the chunk
    ],
)
def test_num_loadable_tokens(
    prompt_len: int, num_computed: int, num_stored: int, block_size: int, expected: int
) -> None:
    assert num_loadable_tokens(prompt_len, num_computed, num_stored, block_size) == expected


def test_load_is_planned_at_lookup_and_emitted_when_scheduled() -> None:
    tracker = RequestTracker(32, 16)
    prompt = list(range(100))
    assert tracker.on_lookup("r", prompt, NS, 16, 64) == 48
    tracker.on_alloc("r", 48)
    assert tracker.take_specs() == ([], [])  # nothing until the engine schedules it
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=[5, 6, 7, 8, 9, 10, 11],
        replace_blocks=True,
        num_computed=64,
        num_scheduled=36,
    )
    loads, saves = tracker.take_specs()
    assert loads == [LoadSpec("r", tuple(range(64)), (5, 6, 7, 8, 9, 10, 11), 16, 64, NS)]
    # 100 tokens done: chunks up to 96; the store held 64 already.
    assert saves == [SaveSpec("r", tuple(range(96)), (5, 6, 7, 8, 9, 10, 11), 64, 96, NS)]
    assert tracker.take_specs() == ([], [])


def test_engine_may_allocate_fewer_tokens_than_offered() -> None:
    tracker = RequestTracker(32, 16)
    assert tracker.on_lookup("r", list(range(100)), NS, 0, 96) == 96
    tracker.on_alloc("r", 0)  # engine decided not to load
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=list(range(7)),
        replace_blocks=True,
        num_computed=0,
        num_scheduled=100,
    )
    loads, saves = tracker.take_specs()
    assert loads == []
    assert saves == []  # all three full chunks already stored
    with pytest.raises(ValueError, match="offered"):
        tracker.on_alloc("r", 200)
    with pytest.raises(ValueError, match="no lookup"):
        tracker.on_alloc("unknown", 16)
    tracker.on_alloc("unknown", 0)


def test_chunked_prefill_saves_each_chunk_once() -> None:
    tracker = RequestTracker(32, 16)
    prompt = list(range(150))
    assert tracker.on_lookup("r", prompt, NS, 0, 0) == 0
    tracker.on_alloc("r", 0)
    steps = [(0, 40, [0, 1, 2]), (40, 40, [3, 4]), (80, 40, [5, 6, 7]), (120, 30, [8, 9])]
    ends = []
    for n, (done, scheduled, blocks) in enumerate(steps):
        tracker.on_scheduled(
            "r",
            prompt=None,
            namespace=None,
            block_ids=blocks,
            replace_blocks=n == 0,
            num_computed=done,
            num_scheduled=scheduled,
        )
        loads, saves = tracker.take_specs()
        assert loads == []
        ends.append([(s.skip_tokens, s.end, len(s.block_ids)) for s in saves])
    assert ends == [[(0, 32, 3)], [(32, 64, 5)], [(64, 96, 8)], [(96, 128, 10)]]
    # decode steps after the prompt save nothing more
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=[10],
        replace_blocks=False,
        num_computed=150,
        num_scheduled=1,
    )
    assert tracker.take_specs() == ([], [])


def test_saves_carry_the_blocks_named_at_the_first_lookup() -> None:
    tracker = RequestTracker(32, 16)
    blocks = PromptBlocks((1, 2, 3, 4), 16, cache_salt="acme")
    prompt = list(range(70))
    tracker.on_lookup("r", prompt, NS, 0, 0, blocks)
    tracker.on_lookup("r", prompt, NS, 0, 0)  # vLLM asks again: the blocks stay
    tracker.on_alloc("r", 0)
    for n, (done, scheduled) in enumerate([(0, 40), (40, 30)]):
        tracker.on_scheduled(
            "r",
            prompt=None,
            namespace=None,
            block_ids=[n * 3, n * 3 + 1, n * 3 + 2],
            replace_blocks=n == 0,
            num_computed=done,
            num_scheduled=scheduled,
        )
    _, saves = tracker.take_specs()
    assert [(s.end, s.blocks) for s in saves] == [(32, blocks), (64, blocks)]
    tracker.on_lookup("q", prompt, NS, 0, 0)
    tracker.on_alloc("q", 0)
    tracker.on_scheduled(
        "q",
        prompt=None,
        namespace=None,
        block_ids=[9] * 5,
        replace_blocks=True,
        num_computed=0,
        num_scheduled=70,
    )
    assert [s.blocks for s in tracker.take_specs()[1]] == [None]  # nothing named: nothing to announce


def test_preempted_request_reloads_into_its_new_blocks() -> None:
    tracker = RequestTracker(32, 16)
    prompt = list(range(80))
    tracker.on_lookup("r", prompt, NS, 0, 64)
    tracker.on_alloc("r", 64)
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=[1, 2, 3, 4, 5],
        replace_blocks=True,
        num_computed=64,
        num_scheduled=16,
    )
    tracker.take_specs()
    assert tracker.num_stored("r") == 64
    # preempted; vLLM asks again, then resumes it with new blocks
    assert tracker.on_lookup("r", prompt, NS, 0, 64) == 64
    tracker.on_alloc("r", 64)
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=[9, 8, 7, 6, 5],
        replace_blocks=True,
        num_computed=64,
        num_scheduled=16,
    )
    loads, saves = tracker.take_specs()
    assert loads == [LoadSpec("r", tuple(range(64)), (9, 8, 7, 6, 5), 0, 64, NS)]
    assert saves == []
    tracker.finish("r")
    assert "r" not in tracker and len(tracker) == 0


def test_unknown_request_without_prompt_is_ignored_and_save_off_saves_nothing() -> None:
    tracker = RequestTracker(32, 16, save=False)
    tracker.on_scheduled(
        "x", prompt=None, namespace=None, block_ids=[1], replace_blocks=True, num_computed=0, num_scheduled=16
    )
    assert "x" not in tracker
    tracker.on_scheduled(
        "y",
        prompt=list(range(64)),
        namespace=NS,
        block_ids=[1, 2, 3, 4],
        replace_blocks=True,
        num_computed=0,
        num_scheduled=64,
    )
    assert "y" in tracker
    assert tracker.take_specs() == ([], [])


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        RequestTracker(0, 16)
    with pytest.raises(ValueError, match="positive"):
        num_loadable_tokens(10, 0, 0, 0)


def test_a_pinned_request_pins_what_the_store_held_and_each_later_save() -> None:
    tracker = RequestTracker(32, 16)
    prompt = list(range(100))
    tracker.on_lookup("r", prompt, NS, 0, 32, pin_ttl_s=60.0)  # one chunk stored before
    tracker.on_alloc("r", 32)
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=range(7),
        replace_blocks=True,
        num_computed=32,
        num_scheduled=68,
    )
    _, saves = tracker.take_specs()
    pin_only, save = saves
    assert (pin_only.skip_tokens, pin_only.end, pin_only.pin_ttl_s) == (32, 32, 60.0)
    assert pin_only.token_ids == tuple(prompt[:32])
    assert (save.skip_tokens, save.end, save.pin_ttl_s) == (32, 96, 60.0)
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=[],
        replace_blocks=False,
        num_computed=100,
        num_scheduled=1,
    )
    assert tracker.take_specs() == ([], []), "the stored chunks were pinned once"


def test_an_unpinned_request_emits_no_pin() -> None:
    tracker = RequestTracker(32, 16)
    prompt = list(range(100))
    tracker.on_lookup("r", prompt, NS, 0, 32)
    tracker.on_scheduled(
        "r",
        prompt=None,
        namespace=None,
        block_ids=range(7),
        replace_blocks=True,
        num_computed=32,
        num_scheduled=68,
    )
    (save,) = tracker.take_specs()[1]
    assert save.pin_ttl_s is None and (save.skip_tokens, save.end) == (32, 96)


def test_a_load_at_the_threshold_is_planned_in_the_background_at_allocation() -> None:
    tracker = RequestTracker(32, 16, background_load_min_tokens=48)
    prompt = list(range(100))
    assert tracker.on_lookup("small", prompt, NS, 32, 64) == 32
    assert not tracker.loads_in_background("small")  # 32 tokens: loaded in the step
    assert tracker.on_lookup("big", prompt, NS, 16, 64) == 48
    assert tracker.loads_in_background("big")
    with pytest.raises(ValueError, match="needs the request's blocks"):
        tracker.on_alloc("big", 48)
    tracker.on_alloc("big", 48, [7, 8, 9, 10, 11, 12, 13])
    loads, _ = tracker.take_specs()
    assert loads == [LoadSpec("big", tuple(range(64)), (7, 8, 9, 10, 11, 12, 13), 16, 64, NS, True)]
    # scheduled once its KV arrived (64 tokens computed): nothing is loaded twice
    tracker.on_scheduled(
        "big",
        prompt=None,
        namespace=None,
        block_ids=[7, 8, 9, 10, 11, 12, 13],
        replace_blocks=True,
        num_computed=64,
        num_scheduled=36,
    )
    loads, _ = tracker.take_specs()
    assert loads == []
    assert not RequestTracker(32, 16).loads_in_background("big")  # no threshold: always in the step


def test_a_background_load_that_failed_is_not_offered_again() -> None:
    tracker = RequestTracker(32, 16, background_load_min_tokens=1)
    prompt = list(range(100))
    for req_id, blocks in (("bad", [1, 2, 3, 4]), ("good", [5, 6, 7, 8])):
        assert tracker.on_lookup(req_id, prompt, NS, 0, 64) == 64
        tracker.on_alloc(req_id, 64, blocks)
    tracker.on_background_loads_done({"bad", "good"}, {3})
    assert tracker.num_stored("bad") == 0 and tracker.num_stored("good") == 64
    assert tracker.on_lookup("bad", prompt, NS, 0, tracker.num_stored("bad") or 0) == 0
