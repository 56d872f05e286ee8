"""SHARED announcements of the vLLM connector, piece by piece: the event a landed shared-tier write
becomes, and which write reports become events."""

from __future__ import annotations

import pytest

from kvmesh.core.events import BlockStored
from kvmesh.core.shared_writes import PromptBlocks, SharedWriteAnnouncer, shared_stored_event

PROMPT = list(range(1000, 1100))
BLOCKS = PromptBlocks((11, 12, 13, 14, 15, 16), 16)


@pytest.mark.parametrize(
    ("lora", "salt", "expected"),
    [
        (None, None, [None, None, None]),
        (None, "acme", [("acme",), None, None]),
        ("sql", None, [("sql",), ("sql",), ("sql",)]),
        ("sql", "acme", [("sql", "acme"), ("sql",), ("sql",)]),
    ],
)
def test_extra_keys_follow_vllms_event_format(lora: str | None, salt: str | None, expected: list) -> None:
    blocks = PromptBlocks((1, 2, 3), 16, lora_name=lora, cache_salt=salt)
    assert blocks.extra_keys(3) == expected


def test_event_names_the_blocks_from_the_root_up_to_end() -> None:
    blocks = PromptBlocks(
        (11, 12, 13, 14, 15, 16),
        16,
        lora_id=3,
        lora_name="sql",
        cache_salt="acme",
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        session_id="s-1",
    )
    event = shared_stored_event(blocks, PROMPT, 64, BlockStored)
    assert event == BlockStored(
        block_hashes=[11, 12, 13, 14],
        parent_block_hash=None,
        token_ids=PROMPT[:64],
        block_size=16,
        lora_id=3,
        medium="SHARED",
        lora_name="sql",
        extra_keys=[("sql", "acme"), ("sql",), ("sql",), ("sql",)],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        session_id="s-1",
    )


def test_event_covers_only_whole_named_blocks() -> None:
    assert shared_stored_event(BLOCKS, PROMPT, 40, BlockStored).block_hashes == [11, 12]
    assert shared_stored_event(BLOCKS, PROMPT, 15, BlockStored) is None
    # no more blocks than vLLM named (the prompt's whole store chunks) or the tokens cover
    assert len(shared_stored_event(BLOCKS, PROMPT, 4096, BlockStored).block_hashes) == 6
    assert len(shared_stored_event(BLOCKS, PROMPT[:50], 4096, BlockStored).token_ids) == 48


def test_event_leaves_unset_optional_fields_out() -> None:
    seen: dict[str, object] = {}

    def older_block_stored(**fields: object) -> dict[str, object]:
        seen.update(fields)
        return fields

    shared_stored_event(BLOCKS, PROMPT, 32, older_block_stored)  # type: ignore[arg-type]
    assert set(seen) == {
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    }


def test_only_shared_tiers_that_hold_more_are_announced() -> None:
    announcer = SharedWriteAnnouncer(BlockStored)
    report = announcer.on_written(BLOCKS, PROMPT[:96])
    report("cpu", 64)
    report("disk", 64)
    assert announcer.take_events() == []
    report("fs", 32)
    report("redis", 32)  # a second shared tier holding as much adds nothing
    report("valkey", 64)
    assert [len(e.block_hashes) for e in announcer.take_events()] == [2, 4]
    assert announcer.take_events() == []
    other = announcer.on_written(BLOCKS, PROMPT[:96])  # each save reports on its own
    other("fs", 32)
    assert [(e.medium, e.token_ids) for e in announcer.take_events()] == [("SHARED", PROMPT[:32])]
