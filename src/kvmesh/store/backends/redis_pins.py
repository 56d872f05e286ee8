"""Pins in a Redis/Valkey tier: pinned chunks lose their TTL, a ledger in the server gives it back.

Redis evicts under ``maxmemory`` by policy, not by key name, so a pinned key must be one the policy
never picks: under ``volatile-lru`` (or ``volatile-lfu`` / ``-random`` / ``-ttl``) only keys with a
TTL are evicted. The design::

    ordinary chunk   SET key value PX redis_ttl_s        volatile: LRU-evictable, expires anyway
    pinned chunk     PERSIST key                          no TTL: never evicted, never expires
    ledger           <prefix>:pins:exp        sorted set  "<tenant id>|<key>" → deadline (ms)
                     <prefix>:pins:t:<tenant> hash        key → bytes pinned
                     <prefix>:pins:u:<tenant> string      the tenant's pinned bytes

One Lua call releases the pins past their deadline (``PEXPIRE key redis_ttl_s``: an ordinary
chunk again), checks the tenant's budget and pins, atomically, so engines sharing the server share
one budget and two pins never both squeeze in. Every writer runs the release at most once a second
before writing (:meth:`RedisPinLedger.maybe_release`): memory pressure comes only from writes, so
an expired pin is released before it could cost an ordinary chunk its place. Each release also
walks the next 1,024 live pins (a cursor in the ledger) and gives back ``PERSIST`` to any that a
concurrent writer rewrote (two engines that both found a new chunk missing both ``SET … PX`` it,
and the later one restores a TTL). A call costs the server a bounded slice of work however many
pins there are (``benchmarks/store_pins.py``); the price is that such a rewritten pin may stay
evictable until the cursor comes round (live pins / 1,024 seconds with one writer).

Under an ``allkeys-*`` policy any key may be evicted, so pins are refused with that reason; so are
pins on a Redis Cluster (the ledger call touches keys of many slots).
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import RedisError

from kvmesh.errors import TierUnavailableError
from kvmesh.store.pins import PinLedger, PinOutcome, PinRequest, tenant_id

RELEASE_INTERVAL_S = 1.0
"""Least time between two releases run by one writer."""
_POLICY_RECHECK_S = 60.0
_RELEASE_BATCH = 1024

_SCRIPT = """
local P, mode, tid = ARGV[1], ARGV[2], ARGV[3]
local now, expiry = tonumber(ARGV[4]), tonumber(ARGV[5])
local budget, ttl, estimate = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local exp = P .. ':pins:exp'
local released = 0
local due = redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, __BATCH__)
for _, m in ipairs(due) do
  local sep = string.find(m, '|', 1, true)
  local owner, key = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  local size = tonumber(redis.call('HGET', P .. ':pins:t:' .. owner, key) or '0')
  redis.call('HDEL', P .. ':pins:t:' .. owner, key)
  redis.call('DECRBY', P .. ':pins:u:' .. owner, size)
  redis.call('ZREM', exp, m)
  if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
  released = released + 1
end
if mode == 'release' then
  local cursor_key = P .. ':pins:cursor'
  local cursor = tonumber(redis.call('GET', cursor_key) or '0')
  local slice = redis.call('ZRANGE', exp, cursor, cursor + __BATCH__ - 1)
  for _, m in ipairs(slice) do
    local key = string.sub(m, string.find(m, '|', 1, true) + 1)
    if redis.call('PTTL', key) > 0 then redis.call('PERSIST', key) end
  end
  if #slice < __BATCH__ then
    redis.call('DEL', cursor_key)
  else
    redis.call('SET', cursor_key, cursor + __BATCH__)
  end
  return {released}
end
local sizes_key, used_key = P .. ':pins:t:' .. tid, P .. ':pins:u:' .. tid
local used = tonumber(redis.call('GET', used_key) or '0')
local add, pinned, missing = 0, 0, 0
local sizes = {}
for i, key in ipairs(KEYS) do
  local size = redis.call('STRLEN', key)
  sizes[i] = size
  if size == 0 then
    missing = missing + 1
    if estimate >= 0 then
      add = add + estimate
      pinned = pinned + 1
    end
  else
    pinned = pinned + 1
    if redis.call('HEXISTS', sizes_key, key) == 0 then add = add + size end
  end
end
if used + add > budget then return {0, pinned, missing, used, add} end
if estimate >= 0 then return {1, pinned, missing, used, add} end
for i, key in ipairs(KEYS) do
  if sizes[i] > 0 then
    local m = tid .. '|' .. key
    local old = redis.call('ZSCORE', exp, m)
    if (not old) or tonumber(old) < expiry then redis.call('ZADD', exp, expiry, m) end
    redis.call('HSETNX', sizes_key, key, sizes[i])
    redis.call('PERSIST', key)
  end
end
redis.call('INCRBY', used_key, add)
return {1, pinned, missing, used + add, add}
""".replace("__BATCH__", str(_RELEASE_BATCH))

_EVICTING_ANY_KEY = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


class RedisPinLedger:
    """The pin ledger of one :class:`~kvmesh.store.backends.redis.RedisBackend`.

    Args:
        client: the backend's ``redis.asyncio`` client.
        key_prefix: the backend's key prefix (the ledger lives beside the chunks).
        key_name: maps a store key to its Redis key name.
        unpinned_ttl_ms: the TTL a released chunk gets back (the backend's ``ttl_s``); ``None``
            leaves it without one.
        cluster: the backend talks to a Redis Cluster (pins refused).
        url: for messages.
    """

    def __init__(
        self,
        client: Any,
        key_prefix: str,
        key_name: Any,
        *,
        unpinned_ttl_ms: int | None,
        cluster: bool,
        url: str,
    ) -> None:
        self._client = client
        self._prefix = key_prefix
        self._key_name = key_name
        self._ttl_ms = unpinned_ttl_ms or 0
        self._cluster = cluster
        self._url = url
        self._script: Any = None if cluster else client.register_script(_SCRIPT)
        self._policy = ""
        self._policy_checked = -_POLICY_RECHECK_S
        self._last_release = 0.0

    async def _call(self, keys: list[str], args: list[Any]) -> list[int]:
        try:
            reply = await self._script(keys=keys, args=[self._prefix, *args])
        except (RedisError, OSError) as exc:
            raise TierUnavailableError(f"redis tier {self._url}: pin ledger call failed: {exc}") from exc
        return [int(x) for x in reply]

    async def _eviction_policy(self) -> str:
        now = time.monotonic()
        if now - self._policy_checked >= _POLICY_RECHECK_S:
            try:
                info = await self._client.info("memory")
            except (RedisError, OSError) as exc:
                raise TierUnavailableError(f"redis tier {self._url}: INFO failed: {exc}") from exc
            self._policy = str(info.get("maxmemory_policy", ""))
            self._policy_checked = now
        return self._policy

    async def pin_many(self, request: PinRequest) -> PinOutcome:
        budget_bytes, estimate_bytes = request.budget_bytes, request.estimate_bytes
        expires_at = time.time() + request.ttl_s
        reason = ""
        if self._cluster:
            reason = f"store tier 'redis' cannot pin on a Redis Cluster ({self._url}): use a single server"
        else:
            policy = await self._eviction_policy()
            if policy in _EVICTING_ANY_KEY:
                reason = (
                    f"store tier 'redis' cannot pin: the server's maxmemory-policy is {policy}, which "
                    "evicts any key; run it with volatile-lru (and set redis_ttl_s)"
                )
        if reason:
            return PinOutcome("redis", False, 0, 0, 0, 0, budget_bytes, 0.0, reason)
        names = list(dict.fromkeys(self._key_name(k) for k in request.keys))
        now_ms = int(time.time() * 1000)
        accepted, pinned, missing, used, added = await self._call(
            names,
            [
                "check" if estimate_bytes is not None else "pin",
                tenant_id(request.tenant),
                now_ms,
                int(expires_at * 1000),
                budget_bytes,
                self._ttl_ms,
                -1 if estimate_bytes is None else estimate_bytes,
            ],
        )
        self._last_release = time.monotonic()
        return PinOutcome(
            "redis",
            bool(accepted),
            pinned,
            missing,
            used,
            added,
            budget_bytes,
            expires_at if accepted else 0.0,
        )

    async def release_expired(self) -> int:
        if self._cluster:
            return 0
        self._last_release = time.monotonic()
        (released,) = await self._call([], ["release", "", int(time.time() * 1000), 0, 0, self._ttl_ms, -1])
        return released

    async def maybe_release(self) -> None:
        """:meth:`release_expired` unless this ledger ran it within :data:`RELEASE_INTERVAL_S`."""
        if not self._cluster and time.monotonic() - self._last_release >= RELEASE_INTERVAL_S:
            # stamped first: a tier that is down is not asked again before the interval
            self._last_release = time.monotonic()
            await self.release_expired()


_check: type[PinLedger] = RedisPinLedger
