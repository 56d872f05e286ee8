# Over 450 lines: one class, because vLLM loads a connector as one class serving both its scheduler and worker roles; the rest lives in vllm_compat, vllm_format, bridge_pool, paged_kv, request_tracker, store_bridge, paged_transfer.
"""A vLLM (v1 engine) KV connector that loads prompt-prefix KV from, and saves it to, the kvmesh store.

Enable it with no change to vLLM::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVMeshConnector",
        "kv_connector_module_path": "kvmesh.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "valkey://cache:6379/0"}}'

vLLM creates one connector in the scheduler and one per worker; this module is only glue
between vLLM's objects and kvmesh's own parts::

    scheduler  get_num_new_matched_tokens ─► StoreBridge.begin_lookup / poll_lookup (None while it
                                             runs: vLLM asks again next step) ─► RequestTracker.on_lookup
               update_state_after_alloc   ─► RequestTracker.on_alloc
               build_connector_meta       ─► RequestTracker.on_scheduled / take_specs ─► metadata
    worker     register_kv_caches         ─► declared_kv_layout ─► paged_kv.detect_geometry ─► PagedKVTransfer
               start_load_kv              ─► PagedKVTransfer.load  (blocking, bounded; failed blocks
                                             reported through get_block_ids_with_load_errors)
               wait_for_save              ─► PagedKVTransfer.save  (copy out, store in background)
               get_kv_connector_kv_cache_events ─► SharedWriteAnnouncer.take_events (saves that
                                             landed in a shared tier, as SHARED BlockStored events)
    scheduler  update_connector_output    ─► those events ─► take_events ─► vLLM's KV event publisher

Store keys name the model, revision, LoRA, tenant (the request's ``cache_salt``), the KV dtype and
the per-worker layout (layers, KV heads, head size, and tensor-parallel rank when TP > 1), so
replicas of one model share chunks and nothing else does. Requests with multimodal inputs or
prompt embeddings are neither loaded nor saved (their token ids do not identify their KV).

vLLM's base classes come from :mod:`~kvmesh.integrations.vllm_compat`: without vLLM this module
still imports, and the connector class can be driven by anything that makes vLLM's calls. The KV
format and layout read from vLLM's config live in :mod:`~kvmesh.integrations.vllm_format`, the
per-process store bridges in :mod:`~kvmesh.integrations.bridge_pool`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvmesh.core.hashing import Namespace
from kvmesh.core.pins import transfer_pin_ttl
from kvmesh.core.shared_writes import PromptBlocks, SharedWriteAnnouncer
from kvmesh.core.types import ExternalBlockHash, Medium
from kvmesh.errors import RequestError
from kvmesh.integrations.background_loader import BackgroundLoader
from kvmesh.integrations.background_saver import BackgroundSaver
from kvmesh.integrations.bridge_pool import BRIDGES
from kvmesh.integrations.connector_config import ConnectorSettings
from kvmesh.integrations.paged_kv import check_layers, detect_geometry
from kvmesh.integrations.paged_transfer import PagedKVTransfer
from kvmesh.integrations.request_tracker import LoadSpec, RequestTracker, SaveSpec
from kvmesh.integrations.store_bridge import PendingLookup
from kvmesh.integrations.vllm_compat import (
    BlockStoredEvent,
    ConnectorBase,
    MetadataBase,
    SharedTierEvents,
    cache_hit_source,
    external_block_hash,
    kv_group_tags,
    tensor_parallel_rank,
)
from kvmesh.integrations.vllm_format import cache_hit_source_name, declared_kv_layout, model_kv_format

# Under vLLM's logger tree: vLLM configures only "vllm.*", so the connector's lines show in the
# server's log, in its format and at its level, next to vLLM's own.
_log = logging.getLogger("vllm.kvmesh.connector")
_SAVER_CLOSE_TIMEOUT_S = 30.0


@dataclass
class KVMeshConnectorMetadata(MetadataBase):
    """What the scheduler's connector sends the workers each step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()


def _first_group(block_ids: Any) -> list[int] | None:
    """Block ids of the first (only) KV cache group: vLLM passes a tuple of lists, older ones a list."""
    if block_ids is None:
        return None
    if len(block_ids) and isinstance(block_ids[0], list | tuple):
        return list(block_ids[0])
    return list(block_ids)


def _pin_ttl(request: Any) -> float | None:
    """The pin a request asks for in ``kv_transfer_params`` (:mod:`kvmesh.core.pins`); a malformed
    one is logged and ignored (vLLM accepted the request before the connector sees it)."""
    try:
        return transfer_pin_ttl(getattr(request, "kv_transfer_params", None))
    except RequestError as exc:
        _log.warning("request %s: %s; not pinned", getattr(request, "request_id", "?"), exc.message)
        return None


def _keyed_by_tokens(request: Any) -> bool:
    """Whether the prompt's token ids alone determine its KV (not so with images or embeddings)."""
    if getattr(request, "mm_features", None) or getattr(request, "mm_hashes", None):
        return False
    return getattr(request, "prompt_embeds", None) is None and bool(
        getattr(request, "prompt_token_ids", None)
    )


class KVMeshConnector(ConnectorBase):
    """vLLM v1 KV connector backed by :class:`~kvmesh.store.cache_engine.KVCacheEngine`.

    Args:
        vllm_config: vLLM's config; ``kv_transfer_config.kv_connector_extra_config`` holds the
            :class:`ConnectorSettings`.
        role: scheduler or worker.
        kv_cache_config: vLLM's KV cache config (newer vLLM passes it; one KV cache group only).

    Raises:
        ValueError: a model, KV cache or setting the connector does not handle.
        ConfigError: invalid connector or store settings.
    """

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a later miss, not a lost hand-off."""
        return False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        try:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        except TypeError:
            super().__init__(vllm_config=vllm_config, role=role)  # vLLM before kv_cache_config existed
        if not hasattr(ConnectorBase, "get_block_ids_with_load_errors"):
            raise ValueError(
                "this vLLM cannot recompute blocks whose load failed (no get_block_ids_with_load_errors); "
                "KVMeshConnector needs a vLLM that has it"
            )
        if getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            _log.warning(
                "kv_load_failure_policy is not 'recompute': a request whose KV load comes up short "
                "will fail instead of recomputing"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise ValueError(f"KVMeshConnector handles one KV cache group, the model has {len(groups)}")
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        self.settings = ConnectorSettings.from_extra_config(extra)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.kv_format = model_kv_format(vllm_config)
        model_config = vllm_config.model_config
        self.model = self.settings.model or str(
            getattr(model_config, "served_model_name", None) or model_config.model
        )
        self.revision = self.settings.revision or str(getattr(model_config, "revision", None) or "")
        self.bridge = BRIDGES.acquire(self.settings)
        fmt = self.kv_format
        element_bytes = 4 if fmt.kv_dtype == "float32" else 2
        # A process that only reads learns no chunk size from its writes: announce it, so its first
        # long read gets the transfer allowance instead of the bare timeout.
        self.bridge.engine.tiered.expect_chunk_bytes(
            self.bridge.chunk_size * 2 * fmt.num_layers * fmt.num_kv_heads * fmt.head_dim * element_bytes
        )
        self._set_cache_hit_source()
        token_bytes = 2 * fmt.num_layers * fmt.num_kv_heads * fmt.head_dim * element_bytes
        self.tracker = RequestTracker(
            self.bridge.chunk_size,
            self.block_size,
            save=self.settings.save,
            background_load_min_tokens=max(
                1, -(-int(self.settings.async_load_min_mib * 2**20) // token_bytes)
            ),
        )
        self.transfer: PagedKVTransfer | None = None
        self._failed_blocks: set[int] = set()
        self.announces_shared_writes = self._will_announce(vllm_config, kv_cache_config)
        self._group_tags = kv_group_tags(kv_cache_config)
        self._to_external_hash = external_block_hash()
        self._announcer: SharedWriteAnnouncer | None = None
        self._shared_events: list[Any] = []
        self._saving_req_ids: set[str] = set()
        self._pending_lookups: dict[str, PendingLookup] = {}
        self._lookup_wait_left = self.settings.lookup_timeout_s
        self._saver: BackgroundSaver | None = None
        self._loader: BackgroundLoader | None = None

    def _will_announce(self, vllm_config: Any, kv_cache_config: Any) -> bool:
        """Whether saves that land in a shared tier become SHARED KV events: the setting is on,
        this replica saves, vLLM publishes KV events, the store has a shared tier, and vLLM hashes
        blocks at the block size the connector addresses."""
        events_config = getattr(vllm_config, "kv_events_config", None)
        tiers = self.bridge.engine.tiered.tiers
        if not (
            self.settings.announce_shared_writes
            and self.settings.save
            and getattr(events_config, "enable_kv_cache_events", False)
            and any(Medium.parse(tier.name) is Medium.SHARED for tier in tiers)
        ):
            return False
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
        if hash_block_size not in (None, self.block_size):
            _log.warning(
                "KVMeshConnector: vLLM hashes %s-token blocks, not the %d-token blocks saved; "
                "shared-tier writes are not announced",
                hash_block_size,
                self.block_size,
            )
            return False
        return True

    def _set_cache_hit_source(self) -> None:
        """Label kvmesh's hits in vLLM's ``vllm:external_prefix_cache_hits`` by the store tier."""
        source = cache_hit_source(cache_hit_source_name(getattr(self.bridge.engine, "config", None)))
        if source is not None:
            self._cache_hit_source = source

    # ---------------------------------------------------------------- keys

    def namespace(self, request: Any) -> Namespace:
        """Store namespace of ``request``: model, revision, LoRA, tenant salt and KV format."""
        fmt = self.kv_format
        lora = getattr(request, "lora_request", None)
        salt = getattr(request, "cache_salt", None)
        return Namespace(
            self.model,
            revision=self.revision,
            lora=str(getattr(lora, "lora_name", "") or "") if lora is not None else "",
            tenant=salt or self.settings.tenant,
            kv_dtype=fmt.kv_dtype,
            kv_layout=fmt.layout_name(),
        )

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store can fill (whole blocks, never the last
        prompt token), and whether that load runs in the background (at least
        ``async_load_min_mib`` of KV: vLLM steps other requests meanwhile)."""
        if not _keyed_by_tokens(request):
            return 0, False
        prompt = request.prompt_token_ids
        req_id = request.request_id
        num_stored = self.tracker.num_stored(req_id)
        namespace = self.namespace(request)
        blocks = None
        if num_stored is None:
            limit = len(prompt) - 1
            if len(prompt) < self.bridge.chunk_size or limit - limit % self.block_size <= num_computed_tokens:
                num_stored = 0
            else:
                num_stored = self._poll_lookup(req_id, prompt, namespace)
                if num_stored is None:
                    return None, False
            if self.announces_shared_writes and len(prompt) >= self.bridge.chunk_size:
                blocks = self._prompt_blocks(request)
        num_load = self.tracker.on_lookup(
            req_id, prompt, namespace, num_computed_tokens, num_stored, blocks, _pin_ttl(request)
        )
        return num_load, self.tracker.loads_in_background(req_id)

    def _poll_lookup(self, req_id: str, prompt: list[int], namespace: Namespace) -> int | None:
        """The store's prefix for ``req_id``, or ``None`` while its lookup runs: vLLM then schedules
        other requests and asks again next step, so a slow store delays this request instead of
        turning its lookup into a miss (until ``lookup_deadline_s``)."""
        pending = self._pending_lookups.pop(req_id, None)
        if pending is None:
            pending = self.bridge.begin_lookup(prompt, namespace, self.settings.lookup_deadline_s)
        started = time.monotonic()
        found = self.bridge.poll_lookup(pending, self._lookup_wait_left)
        # One lookup_timeout_s of waiting per step, shared by the step's lookups: a burst of new
        # requests on a slow store holds the step once, not once per request.
        self._lookup_wait_left = max(0.0, self._lookup_wait_left - (time.monotonic() - started))
        if found is None:
            self._pending_lookups[req_id] = pending
        return found

    def _prompt_blocks(self, request: Any) -> PromptBlocks | None:
        """vLLM's names for the blocks of the prompt's whole store chunks (what a SHARED event
        repeats); ``None`` when the request carries no block hashes."""
        hashes = getattr(request, "block_hashes", None)
        if not hashes:
            return None
        chunk = self.bridge.chunk_size
        num_blocks = len(request.prompt_token_ids) // chunk * chunk // self.block_size
        convert = self._to_external_hash
        external: tuple[ExternalBlockHash, ...] = tuple(convert(h) for h in hashes[:num_blocks])
        lora = getattr(request, "lora_request", None)
        group_idx, kind, window = self._group_tags
        return PromptBlocks(
            external,
            self.block_size,
            lora_id=getattr(lora, "lora_int_id", None) if lora is not None else None,
            lora_name=str(lora.lora_name) if lora is not None else None,
            cache_salt=getattr(request, "cache_salt", None) or None,
            group_idx=group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            session_id=getattr(request, "session_id", None),
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` tokens (0: nothing to load); a background load
        is planned on the request's blocks now, since vLLM will not schedule it until it is done."""
        block_ids = None
        if num_external_tokens and self.tracker.loads_in_background(request.request_id):
            block_ids = _first_group(blocks.get_block_ids())
        self.tracker.on_alloc(request.request_id, num_external_tokens, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVMeshConnectorMetadata:
        """This step's loads and saves, from the requests vLLM scheduled."""
        self._lookup_wait_left = self.settings.lookup_timeout_s  # the next step's lookups may wait again
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.tracker.on_scheduled(
                new.req_id,
                prompt=None,
                namespace=None,
                block_ids=_first_group(new.block_ids),
                replace_blocks=True,
                num_computed=new.num_computed_tokens,
                num_scheduled=num_scheduled.get(new.req_id, 0),
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        resumed_flags = getattr(cached, "resumed_from_preemption", None)
        for i, req_id in enumerate(cached.req_ids):
            if resumed_ids is not None:
                resumed = req_id in resumed_ids
            else:
                resumed = bool(resumed_flags[i]) if resumed_flags is not None else False
            self.tracker.on_scheduled(
                req_id,
                prompt=None,
                namespace=None,
                block_ids=_first_group(cached.new_block_ids[i]),
                replace_blocks=resumed,
                num_computed=cached.num_computed_tokens[i],
                num_scheduled=num_scheduled.get(req_id, 0),
            )
        loads, saves = self.tracker.take_specs()
        self._saving_req_ids.update(spec.req_id for spec in saves)
        preempted = frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return KVMeshConnectorMetadata(loads=loads, saves=saves, preempted=preempted)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; a request that had saves keeps its blocks until the workers report
        its saves done in ``get_finished``."""
        self.tracker.finish(request.request_id)
        self._pending_lookups.pop(request.request_id, None)
        had_saves = request.request_id in self._saving_req_ids
        self._saving_req_ids.discard(request.request_id)
        return had_saves, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Keep the SHARED events the workers reported this step for :meth:`take_events`, and note
        background loads that came up short."""
        finished_recving = getattr(connector_output, "finished_recving", None)
        if finished_recving:
            invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
            self.tracker.on_background_loads_done(finished_recving, invalid)
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, SharedTierEvents):
            self._shared_events.extend(events.get_all_events())

    def take_events(self) -> list[Any]:
        """SHARED events since the last call; vLLM publishes them with its own KV events."""
        events, self._shared_events = self._shared_events, []
        return events

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer paged caches (model order) and check them against the model.

        Raises:
            ValueError: the caches are not one tensor per layer of a supported layout, or do not
                match the model's KV format.
        """
        layers = list(kv_caches.values())
        if not layers or not all(isinstance(t, torch.Tensor) for t in layers):
            raise ValueError("KVMeshConnector needs one KV cache tensor per attention layer")
        fmt = self.kv_format.for_rank(self._tp_rank())
        layout, source = declared_kv_layout(
            self._vllm_config, next(iter(kv_caches)), self.block_size, fmt.num_kv_heads, fmt.head_dim
        )
        geometry = detect_geometry(
            layers[0],
            self.block_size,
            layout,
            num_kv_heads=fmt.num_kv_heads,
            head_dim=fmt.head_dim,
            source=source,
        )
        check_layers(layers, geometry)
        _log.info(
            "KVMeshConnector: %d layers, %s layout (%s), %d-token blocks%s",
            len(layers),
            geometry.layout.value,
            source,
            geometry.block_size,
            f" in {geometry.tensor_block_size}-token kernel blocks" if geometry.kernel_block_size else "",
        )
        found = (geometry.store_dtype, len(layers), geometry.num_kv_heads, geometry.head_dim)
        expected = (fmt.kv_dtype, fmt.num_layers, fmt.num_kv_heads, fmt.head_dim)
        if found != expected:
            raise ValueError(f"KV caches hold (dtype, layers, heads, dim) {found}, the model says {expected}")
        self.kv_format = fmt
        self.transfer = PagedKVTransfer(layers, geometry, self.bridge)
        if self.announces_shared_writes and fmt.tp_rank == 0:
            self._announcer = SharedWriteAnnouncer(BlockStoredEvent)

    def _tp_rank(self) -> int:
        return 0 if self.kv_format.tp_size == 1 else tensor_parallel_rank()

    def _worker_namespace(self, spec_namespace: Namespace) -> Namespace:
        """The scheduler keys by rank 0's layout; each worker reads and writes its own rank's."""
        layout = self.kv_format.layout_name()
        if spec_namespace.kv_layout == layout:
            return spec_namespace
        return spec_namespace.for_store(spec_namespace.kv_dtype, layout)

    def _metadata(self) -> KVMeshConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVMeshConnectorMetadata) else None

    def _background_saver(self) -> BackgroundSaver:
        if self._saver is None:
            self._saver = BackgroundSaver(self._save_now)
        return self._saver

    def _save_now(self, spec: SaveSpec, after: Any) -> None:
        """On the saver thread: copy one save out of the cache (after the step's ``after`` fence)
        and hand it to the store."""
        if self.transfer is None:
            return
        on_written = None
        if self._announcer is not None and spec.blocks is not None:
            on_written = self._announcer.on_written(spec.blocks, spec.token_ids)
        self.transfer.save(_with_namespace(spec, self._worker_namespace(spec.namespace)), on_written, after)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load every planned span into the paged cache before the forward pass."""
        meta = self._metadata()
        if meta is None:
            return
        if meta.preempted and self._saver is not None:
            # A preempted request's blocks are freed at once and may be written this step.
            self._saver.wait_for(meta.preempted)
        if self.transfer is None:
            return
        for spec in meta.loads:
            spec = _with_namespace(spec, self._worker_namespace(spec.namespace))
            if spec.background:
                self._background_loader(spec.end - spec.start).submit(spec)
            else:
                self._failed_blocks |= self.transfer.load(spec)

    def _background_loader(self, spec_tokens: int) -> BackgroundLoader:
        if self._loader is None:
            assert self.transfer is not None
            t = self.transfer
            # A transfer of its own: device copies on a stream of their own, a timeout by size.
            own = PagedKVTransfer(t.layers, t.geometry, t.bridge, background=True)
            self._loader = BackgroundLoader(own.load, own.blocks_of)
            _log.info(
                "KVMeshConnector: first background load (%d tokens); loads of %.0f MiB or more run off the step",
                spec_tokens,
                self.settings.async_load_min_mib,
            )
        return self._loader

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish inside :meth:`start_load_kv`; nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves read every layer at once in :meth:`wait_for_save`, after the forward pass."""

    def wait_for_save(self) -> None:
        """Queue this step's saves on the saver thread; the step does not wait for them."""
        meta = self._metadata()
        if meta is None or not meta.saves:
            return
        saver = self._background_saver()
        fence = None if self.transfer is None else self.transfer.fence()
        for spec in meta.saves:
            saver.submit(spec, fence)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose saves have all run (their blocks may be freed), and requests
        whose background loads ran (blocks they could not fill go to
        :meth:`get_block_ids_with_load_errors`, which vLLM reads after this in the same step)."""
        sending = self._saver.finished(finished_req_ids) if self._saver is not None else None
        recving = None
        if self._loader is not None:
            done = self._loader.take_finished()
            for req_id, failed in done.items():
                if failed:
                    _log.warning(
                        "background load of %s came up short: %d blocks recomputed", req_id, len(failed)
                    )
                self._failed_blocks |= failed
            recving = set(done)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks a load could not fill since the last call (vLLM recomputes them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_kv_cache_events(self) -> SharedTierEvents | None:
        """Saves that landed in a shared tier since the last call, as SHARED ``BlockStored``
        events (``None`` when there are none, and on every rank but 0)."""
        if self._announcer is None:
            return None
        events = self._announcer.take_events()
        return SharedTierEvents(events) if events else None

    def shutdown(self) -> None:
        """Release the store (the last connector of the process closes it)."""
        saver = getattr(self, "_saver", None)
        if saver is not None:
            self._saver = None
            saver.close(_SAVER_CLOSE_TIMEOUT_S)
        loader = getattr(self, "_loader", None)
        if loader is not None:
            self._loader = None
            loader.close(_SAVER_CLOSE_TIMEOUT_S)
        bridge = getattr(self, "bridge", None)
        if bridge is not None:
            self.bridge = None  # type: ignore[assignment]
            BRIDGES.release(bridge)


_Spec = TypeVar("_Spec", LoadSpec, SaveSpec)


def _with_namespace(spec: _Spec, namespace: Namespace) -> _Spec:
    return spec if spec.namespace == namespace else dataclasses.replace(spec, namespace=namespace)
