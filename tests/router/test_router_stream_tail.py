"""The proxy keeps a relayed stream's last bytes (where the usage chunk is) without copying them
for every chunk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvmesh.router.proxy import _USAGE_TAIL, _StreamTail


@given(st.lists(st.binary(max_size=3 * _USAGE_TAIL // 2), max_size=40), st.integers(0, 200))
def test_the_tail_is_the_last_bytes_of_everything_added(chunks: list[bytes], small: int) -> None:
    chunks = chunks + [b"x" * small] * 5
    tail = _StreamTail()
    total = 0
    for chunk in chunks:
        tail.add(chunk)
        total += len(chunk)
        assert tail.size >= min(_USAGE_TAIL, total)
    assert tail.value() == b"".join(chunks)[-_USAGE_TAIL:]
    assert tail.size - len(tail.chunks[0]) < _USAGE_TAIL  # nothing older than needed is kept
