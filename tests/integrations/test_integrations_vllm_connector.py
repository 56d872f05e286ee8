"""KVMeshConnector driven through vLLM's call sequence (scheduler and worker sides) with stand-in
vLLM objects, real paged caches and a real store: what one replica computes, another loads."""

from __future__ import annotations

import importlib.util
import pickle
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from integrations_helpers import bits, paged_cache, read_request, request_kv, write_request
from store_hosts import SlowLink
from vllm_standins import ConnectorRole, make_request, make_vllm_config

from kvmesh.core.events import BlockStored, decode_batch, encode_batch
from kvmesh.core.hashing import BlockHasher, Namespace
from kvmesh.core.shared_writes import SharedWriteAnnouncer
from kvmesh.core.types import Medium, PodId
from kvmesh.engine.store_sync import shared_prompt_blocks
from kvmesh.errors import ConfigError
from kvmesh.integrations.connector_config import ConnectorSettings
from kvmesh.integrations.paged_kv import PagedLayout
from kvmesh.integrations.vllm import KVMeshConnector, KVMeshConnectorMetadata
from kvmesh.integrations.vllm_compat import HAS_VLLM, SharedTierEvents
from kvmesh.integrations.vllm_format import ModelKVFormat, model_kv_format
from kvmesh.router.index import InMemoryIndex
from kvmesh.router.ingest import EventApplier
from kvmesh.router.prefix import match_prefix
from kvmesh.store.local_server import LocalServer, find_server_binary

BS = 16


def new_req_output(req: SimpleNamespace, block_ids: list[int], num_computed: int, num_scheduled: int) -> Any:
    new = SimpleNamespace(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=(block_ids,),
        num_computed_tokens=num_computed,
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: num_scheduled},
    )


class Replica:
    """One vLLM instance: a scheduler-side and a worker-side connector over one paged cache."""

    def __init__(
        self, extra: dict[str, Any], layout: PagedLayout, num_blocks: int = 12, kv_events: bool = False
    ) -> None:
        config = make_vllm_config(extra, kv_events=kv_events)
        self.layout = layout
        self.scheduler = KVMeshConnector(config, ConnectorRole.SCHEDULER)
        self.worker = KVMeshConnector(config, ConnectorRole.WORKER)
        self.layers = paged_cache(layout, fill=5.0, num_blocks=num_blocks)
        self.worker.register_kv_caches(
            {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(self.layers)}
        )

    def step(
        self,
        scheduler_output: Any,
        compute: torch.Tensor | None = None,
        blocks: Sequence[int] = (),
        *,
        await_saves: bool = True,
    ) -> KVMeshConnectorMetadata:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        meta = pickle.loads(pickle.dumps(meta))  # crosses a process boundary in vLLM
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(SimpleNamespace())
        for name in (f"model.layers.{i}.self_attn.attn" for i in range(3)):
            self.worker.wait_for_layer_load(name)
        if compute is not None:  # the forward pass writes the new tokens' KV
            write_request(self.layers, self.layout, blocks, BS, compute)
        for i, layer in enumerate(self.layers):
            self.worker.save_kv_layer(f"model.layers.{i}.self_attn.attn", layer, None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        if await_saves and self.worker._saver is not None:  # the saves run on the saver thread
            assert self.worker._saver.wait_for((s.req_id for s in meta.saves), 10.0)
        return meta

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@pytest.fixture
def fleet_dir(tmp_path: Path) -> str:
    path = tmp_path / "store.yaml"
    path.write_text(f"chunk_size: 32\nshared_dir: {tmp_path / 'fleet'}\n")
    return str(path)


@pytest.fixture
def replicas(fleet_dir: str) -> Iterator[tuple[Replica, Replica]]:
    # different max_inflight → separate stores per replica (separate RAM tiers, one shared directory)
    a = Replica({"store": fleet_dir, "max_inflight": 8}, PagedLayout.KV_FIRST)
    b = Replica({"kvmesh.store": fleet_dir, "kvmesh.max_inflight": 9}, PagedLayout.BLOCKS_FIRST)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_module_imports_without_vllm() -> None:
    assert (importlib.util.find_spec("vllm") is not None) is HAS_VLLM


def test_prefix_computed_by_one_replica_loads_into_another(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    assert a.scheduler.bridge is not b.scheduler.bridge
    assert a.scheduler.bridge is a.worker.bridge  # one store per process and configuration
    prompt = list(range(300, 400))
    kv = request_kv(100, seed=11)
    req = make_request("a-1", prompt)
    assert a.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    a.scheduler.update_state_after_alloc(req, None, 0)
    a_blocks = [8, 3, 5, 0, 1, 2, 9]
    meta = a.step(new_req_output(req, a_blocks, 0, 100), kv, a_blocks)
    assert meta.loads == [] and [(s.skip_tokens, s.end) for s in meta.saves] == [(0, 96)]
    assert a.scheduler.request_finished(req, a_blocks) == (True, None)  # held until saved
    assert a.worker.get_finished({"a-1"}) == ({"a-1"}, None)
    assert a.worker.get_finished(set()) == (None, None)  # reported once
    assert a.worker.bridge.drain(10.0)

    follow = prompt[:96] + list(range(7000, 7014))
    req_b = make_request("b-1", follow)
    # the engine's own prefix cache has the first block: the store fills 16..95
    assert b.scheduler.get_num_new_matched_tokens(req_b, 16) == (80, False)
    assert b.scheduler.get_num_new_matched_tokens(req_b, 16) == (80, False)  # repeated: same answer
    b.scheduler.update_state_after_alloc(req_b, None, 80)
    b_blocks = [11, 4, 6, 10, 7, 3, 2]
    meta = b.step(new_req_output(req_b, b_blocks, 96, 14))
    assert [(s.start, s.end, s.block_ids) for s in meta.loads] == [(16, 96, tuple(b_blocks))]
    assert meta.saves == []  # those chunks are stored already
    assert b.worker.get_block_ids_with_load_errors() == set()
    got = read_request(b.layers, PagedLayout.BLOCKS_FIRST, b_blocks, BS, 110)
    assert torch.equal(bits(got[:, :, :, 16:96]), bits(kv[:, :, :, 16:96]))
    assert bool((got[:, :, :, :16] == 5.0).all()) and bool((got[:, :, :, 96:] == 5.0).all())
    b.scheduler.request_finished(req_b, b_blocks)
    assert len(b.scheduler.tracker) == 0


def test_whole_prompt_hit_leaves_the_last_token_to_the_engine(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    prompt = list(range(64))
    req = make_request("a", prompt)
    a.scheduler.get_num_new_matched_tokens(req, 0)
    a.scheduler.update_state_after_alloc(req, None, 0)
    a.step(new_req_output(req, [0, 1, 2, 3], 0, 64), request_kv(64, seed=12), [0, 1, 2, 3])
    assert a.worker.bridge.drain(10.0)
    assert b.scheduler.get_num_new_matched_tokens(make_request("b", prompt), 0) == (48, False)


def test_tenants_and_loras_do_not_share(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    prompt = list(range(80))
    req = make_request("a", prompt, cache_salt="acme")
    a.scheduler.get_num_new_matched_tokens(req, 0)
    a.scheduler.update_state_after_alloc(req, None, 0)
    a.step(new_req_output(req, [0, 1, 2, 3, 4], 0, 80), request_kv(80, seed=13), [0, 1, 2, 3, 4])
    assert a.worker.bridge.drain(10.0)
    assert b.scheduler.get_num_new_matched_tokens(make_request("b1", prompt, cache_salt="acme"), 0) == (
        64,
        False,
    )
    assert b.scheduler.get_num_new_matched_tokens(make_request("b2", prompt), 0) == (0, False)
    lora = SimpleNamespace(lora_name="sql")
    assert b.scheduler.get_num_new_matched_tokens(
        make_request("b3", prompt, cache_salt="acme", lora_request=lora), 0
    ) == (0, False)


def test_multimodal_and_embedding_requests_are_left_alone(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    req = make_request("mm", list(range(80)), mm_features=[object()])
    assert a.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "mm" not in a.scheduler.tracker
    meta = a.scheduler.build_connector_meta(new_req_output(req, [0, 1, 2, 3, 4], 0, 80))
    assert meta.loads == [] and meta.saves == []
    embeds = make_request("emb", [])
    embeds.prompt_token_ids = None
    assert a.scheduler.get_num_new_matched_tokens(embeds, 0) == (0, False)
    with_embeds = make_request("emb2", list(range(80)), prompt_embeds=torch.zeros(80, 4))
    assert a.scheduler.get_num_new_matched_tokens(with_embeds, 0) == (0, False)


def test_dead_store_means_no_external_tokens() -> None:
    replica = Replica({"store": "redis://127.0.0.1:1/0", "lookup_timeout_s": 1.0}, PagedLayout.KV_FIRST, 20)
    try:
        assert replica.scheduler.bridge.chunk_size == 256
        req = make_request("r", list(range(300)))
        assert replica.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        replica.scheduler.update_state_after_alloc(req, None, 0)
        blocks = list(range(19))
        meta = replica.step(new_req_output(req, blocks, 0, 300), request_kv(300), blocks)
        assert [(s.skip_tokens, s.end) for s in meta.saves] == [(0, 256)]  # offered to the store
        assert replica.worker.bridge.wait_for_saves(5.0)
        assert replica.worker.bridge.stats.num_saves_failed == 0  # the dead tier dropped it quietly
        # the replica's RAM tier still serves what it saved; only the remote tier is gone
        assert replica.scheduler.get_num_new_matched_tokens(make_request("r2", list(range(300))), 0) == (
            256,
            False,
        )
    finally:
        replica.close()


def test_a_slow_store_delays_the_request_instead_of_missing(tmp_path: Path) -> None:
    if find_server_binary("redis") is None:
        pytest.skip("redis-server binary not found")
    with LocalServer("redis") as server:
        link = SlowLink(("127.0.0.1", server.port), delay_s=0.3)
        fast, slow = tmp_path / "fast.yaml", tmp_path / "slow.yaml"
        for path, url in ((fast, server.url), (slow, link.url)):
            path.write_text(f"chunk_size: 32\nlocal_cpu: false\nremote_url: {url}\nremote_timeout_s: 5\n")
        a = Replica({"store": str(fast)}, PagedLayout.KV_FIRST)
        b = Replica(
            {"store": str(slow), "lookup_timeout_s": 0.05, "lookup_deadline_s": 20}, PagedLayout.KV_FIRST
        )
        try:
            prompt = list(range(500, 600))
            req = make_request("a", prompt)
            assert a.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
            a.scheduler.update_state_after_alloc(req, None, 0)
            blocks = [0, 1, 2, 3, 4, 5, 6]
            a.step(new_req_output(req, blocks, 0, 100), request_kv(100, seed=3), blocks)
            assert a.worker.bridge.drain(10.0)

            waits: list[float] = []
            poll = b.scheduler.bridge.poll_lookup

            def recorded_poll(pending: Any, wait_s: float) -> int | None:
                waits.append(wait_s)
                return poll(pending, wait_s)

            b.scheduler.bridge.poll_lookup = recorded_poll  # type: ignore[method-assign]
            req_b, req_c = make_request("b", prompt), make_request("c", prompt)
            # one step: b's lookup waits the step's 0.05 s and is still running; c's does not wait
            step = [b.scheduler.get_num_new_matched_tokens(r, 0) for r in (req_b, req_c)]
            assert step == [(None, False), (None, False)]
            assert waits[0] == pytest.approx(0.05) and waits[1] == 0.0
            answers = step[:1]
            while answers[-1][0] is None and len(answers) < 400:
                b.scheduler.build_connector_meta(empty_output())  # the next step may wait again
                answers.append(b.scheduler.get_num_new_matched_tokens(req_b, 0))
            # vLLM skips the request while its lookup runs (None), then gets the store's prefix
            assert answers[-1] == (96, False), answers
            assert waits[2] == pytest.approx(0.05), waits
            assert b.scheduler.bridge.stats.num_timeouts == 0
            b.scheduler.request_finished(req_c, [])

            gone = make_request("gone", prompt)
            b.scheduler.build_connector_meta(empty_output())
            assert b.scheduler.get_num_new_matched_tokens(gone, 0) == (None, False)
            b.scheduler.request_finished(gone, [])  # aborted while its lookup ran
            assert "gone" not in b.scheduler._pending_lookups
        finally:
            a.close()
            b.close()
            link.close()


def test_worker_rejects_caches_that_do_not_match_the_model(fleet_dir: str) -> None:
    config = make_vllm_config({"store": fleet_dir})
    worker = KVMeshConnector(config, ConnectorRole.WORKER)
    try:
        with pytest.raises(ValueError, match="the model says"):
            worker.register_kv_caches({"l0": paged_cache(PagedLayout.KV_FIRST, num_layers=1)[0]})
        with pytest.raises(ValueError, match="one KV cache tensor"):
            worker.register_kv_caches({})
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_mla": True}, "MLA"),
        ({"pp": 2}, "pipeline"),
        ({"cache_dtype": "fp8"}, "fp8"),
    ],
)
def test_unsupported_setups_fail_at_start(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_kv_format(make_vllm_config({}, **kwargs))


def test_kv_format_names_rank_when_tensor_parallel() -> None:
    fmt = model_kv_format(make_vllm_config({}, tp=2, cache_dtype="float16"))
    assert fmt == ModelKVFormat("float16", 3, 2, 8, 2, 0)
    assert fmt.layout_name() == "L3xH2xD8-tp2r0"
    assert fmt.for_rank(1).layout_name() == "L3xH2xD8-tp2r1"
    assert model_kv_format(make_vllm_config({})).layout_name() == "L3xH2xD8"


def test_settings_parse_and_reject() -> None:
    s = ConnectorSettings.from_extra_config(
        {"kvmesh.store": "memory", "lookup_timeout_s": 0.2, "save": "false", "other_connector_key": 1}
    )
    assert (s.store, s.lookup_timeout_s, s.save, s.max_inflight) == ("memory", 0.2, False, 64)
    assert s.announce_shared_writes is True
    assert not ConnectorSettings.from_extra_config(
        {"kvmesh.announce_shared_writes": "false"}
    ).announce_shared_writes
    for bad in (
        {"kvmesh.stor": "x"},
        {"lookup_timeout_s": 0},
        {"lookup_deadline_s": -1},
        {"max_inflight": 1.5},
        {"save": "maybe"},
        {"store": 3},
        {"announce_shared_writes": "sometimes"},
    ):
        with pytest.raises(ConfigError):
            ConnectorSettings.from_extra_config(bad)


# ---------------------------------------------------------------- SHARED announcements


def shared_store(tmp_path: Path, shared_dir: Path | None = None) -> str:
    path = tmp_path / "shared-store.yaml"
    path.write_text(f"chunk_size: 32\nshared_dir: {shared_dir or tmp_path / 'shared'}\n")
    return str(path)


def save_prompt(replica: Replica, prompt: list[int], **request_fields: Any) -> None:
    """One request through lookup, allocation and a prefill step that saves its whole chunks."""
    hashes = [9000 + i for i in range(len(prompt) // BS)]
    req = make_request("r", prompt, block_hashes=hashes, **request_fields)
    replica.scheduler.get_num_new_matched_tokens(req, 0)
    replica.scheduler.update_state_after_alloc(req, None, 0)
    blocks = list(range(len(prompt) // BS + 1))
    meta = replica.step(new_req_output(req, blocks, 0, len(prompt)), request_kv(len(prompt)), blocks)
    assert [(s.skip_tokens, s.end) for s in meta.saves] == [(0, len(prompt) // 32 * 32)]
    assert replica.worker.bridge.drain(10.0)


def test_a_save_that_lands_in_the_shared_tier_is_announced_through_vllms_channel(tmp_path: Path) -> None:
    replica = Replica({"store": shared_store(tmp_path)}, PagedLayout.KV_FIRST, 20, kv_events=True)
    try:
        assert replica.scheduler.announces_shared_writes
        prompt = list(range(500, 600))
        save_prompt(replica, prompt, cache_salt="acme")
        worker_events = replica.worker.get_kv_connector_kv_cache_events()
        assert isinstance(worker_events, SharedTierEvents)
        assert replica.worker.get_kv_connector_kv_cache_events() is None  # drained
        worker_events = pickle.loads(pickle.dumps(worker_events))  # crosses a process under TP
        replica.scheduler.update_connector_output(SimpleNamespace(kv_cache_events=worker_events))
        events = list(replica.scheduler.take_events())
        assert events == [
            BlockStored(
                block_hashes=[9000 + i for i in range(6)],
                parent_block_hash=None,
                token_ids=prompt[:96],
                block_size=BS,
                lora_id=None,
                medium="SHARED",
                lora_name=None,
                extra_keys=[("acme",), None, None, None, None, None],
            )
        ]
        assert list(replica.scheduler.take_events()) == []

        # a router reading the published batch credits the prefix to every pod
        applier = EventApplier(InMemoryIndex(), model="org/model", block_size=BS)
        applier.apply_batch(PodId("writer"), decode_batch(encode_batch(events)))
        match = match_prefix(applier.index, applier.hasher(tenant="acme"), prompt)
        assert match.shared is not None and match.shared.num_blocks == 6
        assert match.hit_tokens(PodId("any-other-pod")) == 96
    finally:
        replica.close()


@pytest.mark.parametrize("tenant", ["", "acme"])
def test_the_router_indexes_the_engines_and_the_connectors_shared_writes_alike(
    tmp_path: Path, tenant: str
) -> None:
    """kvmesh's engine and the vLLM connector announce through one announcer: for one prompt and
    tenant, a router credits both writes to the same blocks of the same namespace."""
    prompt = list(range(500, 600))
    replica = Replica({"store": shared_store(tmp_path)}, PagedLayout.KV_FIRST, 20, kv_events=True)
    try:
        save_prompt(replica, prompt, cache_salt=tenant or None)
        replica.scheduler.update_connector_output(
            SimpleNamespace(kv_cache_events=replica.worker.get_kv_connector_kv_cache_events())
        )
        from_connector = list(replica.scheduler.take_events())
    finally:
        replica.close()
    keys = BlockHasher(Namespace("org/model", tenant=tenant), BS).hash_blocks(prompt)
    engine = SharedWriteAnnouncer(BlockStored)
    engine.on_written(shared_prompt_blocks(keys, BS, tenant), prompt[:96])(Medium.SHARED, 96)
    from_engine = engine.take_events()
    assert [e.extra_keys for e in from_engine] == [e.extra_keys for e in from_connector]
    assert [e.extra_keys for e in from_engine] == [[("acme",) if tenant else None] + [None] * 5]

    matches = []
    for events in (from_engine, from_connector):
        applier = EventApplier(InMemoryIndex(), model="org/model", block_size=BS)
        applier.apply_batch(PodId("writer"), decode_batch(encode_batch(events)))
        for other in ("" if tenant else "acme", tenant):
            match = match_prefix(applier.index, applier.hasher(tenant=other), prompt)
            matches.append((other, match.hit_tokens(PodId("any-other-pod"))))
    assert matches[:2] == matches[2:]
    assert dict(matches[:2]) == {tenant: 96, "" if tenant else "acme": 0}


@pytest.mark.parametrize("case", ["switched_off", "no_kv_events", "no_shared_tier", "failed_write"])
def test_nothing_is_announced_without_a_landed_shared_write(tmp_path: Path, case: str) -> None:
    extra: dict[str, Any] = {"store": shared_store(tmp_path)}
    kv_events = case != "no_kv_events"
    if case == "switched_off":
        extra["announce_shared_writes"] = False
    elif case == "no_shared_tier":
        ram_only = tmp_path / "ram.yaml"
        ram_only.write_text("chunk_size: 32\n")
        extra["store"] = str(ram_only)
    elif case == "failed_write":
        blocked = tmp_path / "blocked"
        blocked.write_text("a file where the shared directory should be: every write fails")
        extra["store"] = shared_store(tmp_path, blocked)
    replica = Replica(extra, PagedLayout.KV_FIRST, 20, kv_events=kv_events)
    try:
        assert replica.scheduler.announces_shared_writes is (case == "failed_write")
        save_prompt(replica, list(range(500, 600)))
        assert replica.worker.get_kv_connector_kv_cache_events() is None
        assert list(replica.scheduler.take_events()) == []
    finally:
        replica.close()


def test_a_slow_save_does_not_hold_the_step_and_holds_the_blocks(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    assert a.worker.transfer is not None
    release = threading.Event()
    started = threading.Event()
    copy_out = a.worker.transfer.save

    def slow_save(spec: Any, on_written: Any = None, after: Any = None) -> bool:
        started.set()
        assert release.wait(10.0)
        return copy_out(spec, on_written, after)

    a.worker.transfer.save = slow_save  # type: ignore[method-assign]
    req = make_request("slow", list(range(500, 600)))
    a.scheduler.get_num_new_matched_tokens(req, 0)
    a.scheduler.update_state_after_alloc(req, None, 0)
    blocks = [1, 2, 3, 4, 5, 6, 7]
    meta = a.step(new_req_output(req, blocks, 0, 100), request_kv(100, seed=3), blocks, await_saves=False)
    assert [(s.skip_tokens, s.end) for s in meta.saves] == [(0, 96)]
    assert started.wait(10.0)  # the step returned while the save is still running
    assert a.scheduler.request_finished(req, blocks) == (True, None)
    assert a.worker.get_finished({"slow"}) == (None, None)  # blocks stay held
    release.set()
    assert a.worker._saver is not None and a.worker._saver.wait_for({"slow"}, 10.0)
    assert a.worker.get_finished(set()) == ({"slow"}, None)
    assert a.worker.bridge.wait_for_saves(10.0)
    probe = make_request("probe", list(range(500, 600)))
    assert a.scheduler.get_num_new_matched_tokens(probe, 0) == (96, False)


def test_a_failed_save_still_releases_the_blocks(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    assert a.worker.transfer is not None

    def broken_save(spec: Any, on_written: Any = None) -> bool:
        raise RuntimeError("copy failed")

    a.worker.transfer.save = broken_save  # type: ignore[method-assign]
    req = make_request("broken", list(range(700, 800)))
    a.scheduler.get_num_new_matched_tokens(req, 0)
    a.scheduler.update_state_after_alloc(req, None, 0)
    blocks = [1, 2, 3, 4, 5, 6, 7]
    a.step(new_req_output(req, blocks, 0, 100), request_kv(100, seed=4), blocks)
    assert a.scheduler.request_finished(req, blocks) == (True, None)
    assert a.worker.get_finished({"broken"}) == ({"broken"}, None)
    assert a.worker._saver is not None and a.worker._saver.num_failed == 1


def test_a_request_without_saves_frees_its_blocks_at_once(replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    req = make_request("short", list(range(900, 910)))  # under one chunk: nothing to save
    a.scheduler.get_num_new_matched_tokens(req, 0)
    a.scheduler.update_state_after_alloc(req, None, 0)
    meta = a.step(new_req_output(req, [1], 0, 10), request_kv(10, seed=5), [1])
    assert meta.saves == []
    assert a.scheduler.request_finished(req, [1]) == (False, None)
    assert a.worker.get_finished({"short"}) == (None, None)


def empty_output() -> Any:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


def await_recving(replica: Replica, req_id: str) -> None:
    for _ in range(1000):
        _, recving = replica.worker.get_finished(set())
        if recving:
            assert recving == {req_id}
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"background load of {req_id} never reported")


@pytest.mark.parametrize("lose_chunks", [False, True])
def test_a_large_load_runs_in_the_background(tmp_path: Path, lose_chunks: bool) -> None:
    """A load of at least async_load_min_mib is offered as asynchronous: planned on the request's
    blocks at allocation, run off the step, reported in finished_recving; a load that comes up
    short reports its blocks and the request is offered nothing from the store again."""
    store = tmp_path / "store.yaml"
    store.write_text(f"chunk_size: 32\nshared_dir: {tmp_path / 'fleet'}\n")
    a = Replica({"store": str(store), "max_inflight": 8}, PagedLayout.KV_FIRST)
    # 192 bytes of KV per token: 0.01 MiB is 55 tokens, so an 80-token load runs in the background
    b = Replica(
        {"store": str(store), "max_inflight": 9, "async_load_min_mib": 0.01}, PagedLayout.BLOCKS_FIRST
    )
    try:
        prompt = list(range(300, 400))
        kv = request_kv(100, seed=11)
        req = make_request("a-1", prompt)
        a.scheduler.get_num_new_matched_tokens(req, 0)
        a.scheduler.update_state_after_alloc(req, None, 0)
        a.step(new_req_output(req, [8, 3, 5, 0, 1, 2, 9], 0, 100), kv, [8, 3, 5, 0, 1, 2, 9])
        assert a.worker.bridge.drain(10.0)

        req_b = make_request("b-1", prompt[:96] + list(range(7000, 7014)))
        assert b.scheduler.get_num_new_matched_tokens(req_b, 16) == (80, True)
        b_blocks = [11, 4, 6, 10, 7, 3, 2]
        b.scheduler.update_state_after_alloc(req_b, SimpleNamespace(get_block_ids=lambda: (b_blocks,)), 80)
        if lose_chunks:
            for path in (tmp_path / "fleet").rglob("*"):
                if path.is_file():
                    path.unlink()
        meta = b.step(empty_output())  # the request waits for its KV; it is not scheduled
        assert [(s.start, s.end, s.block_ids, s.background) for s in meta.loads] == [
            (16, 96, tuple(b_blocks), True)
        ]
        await_recving(b, "b-1")
        invalid = b.worker.get_block_ids_with_load_errors()
        b.scheduler.update_connector_output(
            SimpleNamespace(finished_recving={"b-1"}, invalid_block_ids=invalid)
        )
        if lose_chunks:
            assert invalid == {4, 6, 10, 7, 3}  # tokens 16..95: every block the load was to write
            assert b.scheduler.get_num_new_matched_tokens(req_b, 0) == (0, False)  # not offered again
            return
        assert invalid == set()
        got = read_request(b.layers, PagedLayout.BLOCKS_FIRST, b_blocks, BS, 110)
        assert torch.equal(bits(got[:, :, :, 16:96]), bits(kv[:, :, :, 16:96]))
        # once scheduled (its loaded tokens computed) the request loads nothing more
        meta = b.step(new_req_output(req_b, b_blocks, 96, 14))
        assert meta.loads == []
    finally:
        a.close()
        b.close()
