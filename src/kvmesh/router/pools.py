"""Several served models behind one gateway: one :class:`~kvmesh.router.gateway.Gateway` per pool.

::

    POST /v1/...  ─► body's ``model`` ─► pool (its model, an alias, or a LoRA adapter its
                      endpoints list) ─► that pool's gateway: its endpoints, index namespace,
                      tokenizer, block size, scheduler and flow control
    GET /v1/models ─► every pool's model and the adapters its endpoints list
    GET /metrics   ─► every pool's metrics, each sample labelled ``pool``
    /pools/<name>/... ─► that pool's own routes (admin API, ``/v1/kvmesh/prewarm``, metrics,
                         models), its gateway's app mounted there

A model no pool serves is a 404 naming the served models. With one pool a request without a
``model`` goes to it; with several it is a 400.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvmesh.core.agent_apis import PromptApi
from kvmesh.router.agent_routes import api_error
from kvmesh.router.client_request import ClientRequest
from kvmesh.router.config import RouterConfig
from kvmesh.router.front_http import HotHandler
from kvmesh.router.gateway import Gateway
from kvmesh.router.ingest_split import IngestSplit
from kvmesh.router.lora_state import adapters_of_models, merged_models, requested_adapter
from kvmesh.router.pool_config import PoolConfig
from kvmesh.router.replies import json_response
from kvmesh.router.tokenize import PromptTokenizer

POOL_LABEL = "pool"

_API_OF_PATH = {api.path: api for api in PromptApi}


class _ModelField(msgspec.Struct):
    model: Any = None


def pool_router_config(router: RouterConfig, pool: PoolConfig) -> RouterConfig:
    """The configuration of ``pool``'s gateway: the router's, with the pool's own keys."""
    index = router.index
    namespace = pool.namespace if pool.namespace is not None else f"{index.key_prefix}{pool.name}:"
    return msgspec.structs.replace(
        router,
        model=pool.model,
        revision=pool.revision if pool.revision is not None else router.revision,
        tokenizer=pool.tokenizer if pool.tokenizer is not None else router.tokenizer,
        block_size=pool.block_size if pool.block_size is not None else router.block_size,
        policy=pool.policy if pool.policy is not None else router.policy,
        scheduler=pool.scheduler
        if pool.scheduler is not None or pool.policy is not None
        else router.scheduler,
        index=msgspec.structs.replace(index, key_prefix=namespace),
        flow_control=pool.flow_control if pool.flow_control is not None else router.flow_control,
        endpoints=list(pool.endpoints),
        discovery=list(pool.discovery),
        pools=[],
    )


class Pool:
    """One served model and the gateway that routes it.

    Args:
        config: the pool's entry in ``pools:``.
        gateway: its gateway (built from :func:`pool_router_config`).
    """

    def __init__(self, config: PoolConfig, gateway: Gateway) -> None:
        self.config = config
        self.name = config.name
        self.model = config.model
        self.gateway = gateway

    def names(self) -> frozenset[str]:
        """The model and its aliases."""
        return frozenset(self.config.served_names)

    def adapters(self) -> frozenset[str]:
        """LoRA adapters this pool's healthy endpoints list (the hook adapter placement reads)."""
        found: set[str] = set()
        for endpoint in self.gateway.endpoints():
            if endpoint.state.healthy:
                found |= adapters_of_models({"data": endpoint.models})
                lora = endpoint.state.lora
                if lora is not None:
                    found |= lora.servable | lora.running
        return frozenset(found)

    def serves(self, model: str) -> bool:
        """Whether requests naming ``model`` belong here: the model, an alias or a listed adapter."""
        if model in self.names():
            return True
        states = [e.state for e in self.gateway.endpoints()]
        return bool(requested_adapter(model, self.model, states)) or model in self.adapters()

    def models(self) -> list[dict[str, Any]]:
        """This pool's ``/v1/models`` entries: its model first, then what its endpoints list."""
        own = {"id": self.model, "object": "model", "owned_by": "kvmesh", "root": self.model, "parent": None}
        listed = merged_models(e.models for e in self.gateway.endpoints() if e.state.healthy and e.models)
        return merged_models([[own], listed])


class PoolLabelCollector(Collector):
    """Every pool's metrics as one set of families, each sample labelled with its pool."""

    def __init__(self, pools: list[Pool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for pool in self.pools:
            for family in pool.gateway.metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    merged.samples.append(sample._replace(labels={POOL_LABEL: pool.name, **sample.labels}))
        yield from families.values()


class PooledRouter:
    """The gateway of a router with ``pools:``: dispatches each request to its model's pool.

    Args:
        config: the router configuration (``config.pools`` non-empty).
        tokenizers: each pool's tokenizer by pool name (missing or ``None``: routed by load only).
        ingest_split: this worker's place among workers that split event ingestion (each pool
            splits its own pods).
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        tokenizers: Mapping[str, PromptTokenizer | None],
        ingest_split: IngestSplit | None = None,
    ) -> None:
        if not config.pools:
            raise ValueError("PooledRouter needs a config with pools; use Gateway for a single model")
        self.config = config
        self.pools = [
            Pool(
                p,
                Gateway(
                    pool_router_config(config, p),
                    tokenizer=tokenizers.get(p.name),
                    ingest_split=None if ingest_split is None else ingest_split.for_scope(p.name),
                ),
            )
            for p in config.pools
        ]
        self.registry = CollectorRegistry()
        self.registry.register(PoolLabelCollector(self.pools))
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        for api in PromptApi:
            app.router.add_post(api.path, self._dispatch)
        for pool in self.pools:
            app.add_subapp(f"/pools/{pool.name}", pool.gateway.app)
        return app

    def pool_for(self, model: str | None) -> Pool | None:
        """The pool serving ``model`` (``None``: the only pool, if there is one)."""
        if not model:
            return self.pools[0] if len(self.pools) == 1 else None
        return next((p for p in self.pools if p.serves(model)), None)

    def served_models(self) -> list[str]:
        """Every pool's model names, in config order."""
        return [name for p in self.pools for name in p.config.served_names]

    def front_routes(self) -> dict[str, HotHandler]:
        """The ``POST`` routes the router's front serves itself (:mod:`kvmesh.router.front_server`)."""
        return {api.path: self._dispatch for api in PromptApi}

    async def _dispatch(self, request: ClientRequest) -> web.StreamResponse:
        api = _API_OF_PATH.get(request.path, PromptApi.CHAT)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return api_error(api, 413, f"request body larger than {self.config.max_body_bytes} bytes")
        try:
            model = msgspec.json.decode(raw, type=_ModelField).model
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
            return api_error(api, 400, f"request body is not a valid JSON object: {exc}")
        if model is not None and not isinstance(model, str):
            return api_error(api, 400, "'model' must be a string", param="model")
        pool = self.pool_for(model)
        served = ", ".join(self.served_models())
        if pool is None and not model:
            return api_error(api, 400, f"'model' is required: this router serves {served}", param="model")
        if pool is None:
            return api_error(
                api,
                404,
                f"The model `{model}` is not served here; served models: {served}",
                param="model",
                kind="not_found_error" if api is PromptApi.MESSAGES else "model_not_found",
            )
        return await pool.gateway.handle(request, api)

    async def _models(self, request: web.Request) -> web.Response:
        data = merged_models(p.models() for p in self.pools)
        return json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        pools = {}
        for pool in self.pools:
            states = [e.state for e in pool.gateway.endpoints()]
            pools[pool.name] = {"endpoints": len(states), "healthy": sum(1 for s in states if s.healthy)}
        ok = all(p["healthy"] for p in pools.values())
        body = {"status": "ok" if ok else "a pool has no healthy endpoint", "pools": pools}
        return json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


def load_pool_tokenizers(config: RouterConfig) -> dict[str, PromptTokenizer | None]:
    """Each pool's tokenizer, loaded from its spec (or the router's); one load per distinct spec.

    Raises:
        ModelLoadError: a tokenizer cannot be loaded.
    """
    from kvmesh.core.tokens import Tokenizer

    loaded: dict[str, PromptTokenizer] = {}
    out: dict[str, PromptTokenizer | None] = {}
    for pool in config.pools:
        spec = pool.tokenizer if pool.tokenizer is not None else config.tokenizer
        if spec and spec not in loaded:
            loaded[spec] = Tokenizer.load(spec)
        out[pool.name] = loaded[spec] if spec else None
    return out
