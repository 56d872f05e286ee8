"""Redis URL forms: valkey:// aliases, TLS and cluster selection, redaction, a real Redis Cluster."""

from __future__ import annotations

import pytest
from store_helpers import LocalCluster, make_key, make_value, unique_prefix

from kvmesh.store.backends.redis import RedisBackend, is_redis_url, normalize_url, redact_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h:1/0", ("redis://h:1/0", False)),
        ("valkey://h:1/2", ("redis://h:1/2", False)),
        ("valkeys://h:1", ("rediss://h:1", False)),
        ("redis+cluster://h:1", ("redis://h:1", True)),
        ("valkey+cluster://h:1", ("redis://h:1", True)),
        ("redis://h:1/0?cluster=true&protocol=3", ("redis://h:1/0?protocol=3", True)),
    ],
)
def test_normalize_url(url: str, expected: tuple[str, bool]) -> None:
    assert normalize_url(url) == expected
    assert is_redis_url(url)


def test_non_redis_urls() -> None:
    assert not is_redis_url("http://h:1")
    with pytest.raises(ValueError, match="not a Redis"):
        normalize_url("memcached://h")


def test_passwords_never_appear() -> None:
    assert redact_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert "secret" not in RedisBackend("redis://:secret@127.0.0.1:1/0").url


async def test_real_redis_cluster_roundtrip(redis_cluster: LocalCluster) -> None:
    backend = RedisBackend(redis_cluster.url, key_prefix=unique_prefix())
    assert backend.cluster
    items = [(make_key(i, group=f"{i % 3:016x}"), make_value(i, 1000)) for i in range(30)]
    assert await backend.put_many(items) == 30
    assert await backend.get_many([k for k, _ in items]) == [v for _, v in items]
    assert await backend.exists_many([k for k, _ in items[:3]]) == [True] * 3
    assert await backend.delete_many([items[0][0]]) == 1
    assert await backend.flush(f"{1:016x}") == 10
    assert sum(await backend.exists_many([k for k, _ in items])) == 19
    assert (await backend.stats()).extra["cluster"] == 1
    assert await backend.flush(None) == 19
    await backend.aclose()
