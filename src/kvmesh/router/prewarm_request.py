"""``POST /v1/kvmesh/prewarm`` on the wire: the body checked field by field, and the report.

::

    {"documents": [{"id": "doc-1", "prompt": "..."}            text (completions tokenization)
                   {"id": "doc-2", "messages": [...]}          chat (the chat template)
                   {"id": "doc-3", "prompt_token_ids": [...]}] token ids as given
     "model": "...", "cache_salt": "...",                      as for a request (LoRA: its model name)
     "kvmesh": {"cache_ttl_s": 3600},                          forwarded untouched with every document
     "wait_for_shared": true, "timeout_s": 60, "concurrency": 4, "store_chunk_tokens": 256}

Every mistake is a :class:`~kvmesh.errors.RequestError` (a 400 naming the field) raised before any
document is computed. Each document becomes the completions or chat body a client would send for
it, so the gateway's :class:`~kvmesh.router.request_parser.RequestParser` tokenizes it exactly as it
tokenizes that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.core.tenancy import CACHE_SALT_FIELD
from kvmesh.errors import RequestError

MAX_DOCUMENTS = 256
"""Most documents in one prewarm request (a client sends more in batches)."""
MAX_CONCURRENCY = 64
DEFAULT_CONCURRENCY = 4
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
DEFAULT_STORE_CHUNK_TOKENS = 256
"""The store's default chunk size: a shared tier holds a prompt in whole chunks of this many tokens."""
KVMESH_FIELD = "kvmesh"
"""The request field of kvmesh's own cache controls (``cache_ttl_s``), forwarded as given."""

_TOP_FIELDS = frozenset(
    {"documents", "model", CACHE_SALT_FIELD, KVMESH_FIELD, "wait_for_shared", "timeout_s", "concurrency",
     "store_chunk_tokens"}
)  # fmt: skip
_DOCUMENT_FIELDS = frozenset({"id", "prompt", "messages", "prompt_token_ids", KVMESH_FIELD})
_CONTENT_FIELDS = ("prompt", "messages", "prompt_token_ids")


@dataclass(slots=True)
class PrewarmDocument:
    """One document to prewarm.

    Attributes:
        id: the client's name for it (its position when it gave none).
        body: the completions or chat body that computes it (no sampling fields yet).
        chat: ``body`` goes to ``/v1/chat/completions`` (else ``/v1/completions``).
    """

    id: str
    body: dict[str, Any]
    chat: bool

    @property
    def path(self) -> str:
        """The OpenAI route of :attr:`body`."""
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass(slots=True)
class PrewarmPlan:
    """A checked prewarm request.

    Attributes:
        documents: the documents, in the client's order.
        wait_for_shared: wait until the fleet's shared tier holds each document and the router
            knows it (else report once the endpoint computed it).
        timeout_s: how long to wait for that per document, after its prefix is computed.
        concurrency: documents computed at once.
        store_chunk_tokens: the store's chunk size (a shared tier holds whole chunks only).
    """

    documents: list[PrewarmDocument]
    wait_for_shared: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    concurrency: int = DEFAULT_CONCURRENCY
    store_chunk_tokens: int = DEFAULT_STORE_CHUNK_TOKENS


class PrewarmResult(msgspec.Struct, kw_only=True):
    """What happened to one document (one entry of the response's ``documents``)."""

    id: str
    status: str
    """``prewarmed`` (computed, and in the shared tier when waited for), ``cached`` (the fleet
    already held it: nothing computed), ``timeout`` (computed, not seen in the shared tier in
    time) or ``failed`` (not computed: see ``error``)."""
    tokens: int = 0
    """Prompt tokens as the engines see them."""
    blocks: int = 0
    """Full blocks (of the router's block size) in the prompt."""
    blocks_cached: int = 0
    """Blocks the fleet already held before (the longest run any endpoint or the shared tier had)."""
    blocks_new: int = 0
    """Blocks the prewarm had to compute (``blocks - blocks_cached``)."""
    tiers_before: dict[str, int] = {}
    """Blocks held per tier before, the most any one holder had in that tier."""
    tiers: dict[str, int] = {}
    """The same after the prewarm."""
    shared_tokens: int = 0
    """Prompt tokens the shared tier holds from the start, as announced to the router."""
    shared_target_tokens: int = 0
    """What the shared tier can hold of it: the prompt's whole store chunks."""
    reached_shared: bool = False
    """The shared tier holds :attr:`shared_target_tokens` and the router knows it."""
    endpoint: str | None = None
    """The endpoint that computed it (``None``: none did)."""
    engine_cached_tokens: int | None = None
    """Prompt tokens the endpoint found cached when computing it (its ``usage``)."""
    seconds: float = 0.0
    error: str | None = None


class PrewarmSummary(msgspec.Struct, kw_only=True):
    """Totals over one prewarm request's documents."""

    documents: int
    prewarmed: int
    cached: int
    timeout: int
    failed: int
    tokens: int
    blocks_new: int
    blocks_cached: int
    seconds: float


class PrewarmResponse(msgspec.Struct, kw_only=True):
    """The body of a prewarm answer."""

    documents: list[PrewarmResult]
    summary: PrewarmSummary
    object: str = "kvmesh.prewarm"


FAILED_STATUSES = frozenset({"failed", "timeout"})
"""Statuses of a document the client should treat as not prewarmed."""


def summarize(results: list[PrewarmResult], seconds: float) -> PrewarmSummary:
    """Totals over ``results``, which took ``seconds`` in all."""
    count = {s: sum(r.status == s for r in results) for s in ("prewarmed", "cached", "timeout", "failed")}
    return PrewarmSummary(
        documents=len(results),
        prewarmed=count["prewarmed"],
        cached=count["cached"],
        timeout=count["timeout"],
        failed=count["failed"],
        tokens=sum(r.tokens for r in results),
        blocks_new=sum(r.blocks_new for r in results),
        blocks_cached=sum(r.blocks_cached for r in results),
        seconds=round(seconds, 3),
    )


def parse_prewarm_body(raw: bytes) -> PrewarmPlan:
    """Check a prewarm body and turn it into a :class:`PrewarmPlan`.

    Raises:
        RequestError: the body is not JSON, has unknown fields, or a field is missing or malformed.
    """
    if not raw:
        raise RequestError("request body is empty; expected a JSON object with 'documents'")
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _TOP_FIELDS)
    if unknown:
        raise RequestError(
            f"unknown prewarm fields {unknown} (expected {sorted(_TOP_FIELDS)})", param=unknown[0]
        )
    shared = _shared_fields(body)
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise RequestError("'documents' must be a non-empty list", param="documents")
    if len(documents) > MAX_DOCUMENTS:
        raise RequestError(
            f"'documents' holds {len(documents)} documents; at most {MAX_DOCUMENTS} per request "
            "(send the rest in further requests)",
            param="documents",
        )
    parsed = [_document(i, doc, shared) for i, doc in enumerate(documents)]
    seen: set[str] = set()
    for doc in parsed:
        if doc.id in seen:
            raise RequestError(f"document id {doc.id!r} appears more than once", param="documents")
        seen.add(doc.id)
    wait = body.get("wait_for_shared", True)
    if not isinstance(wait, bool):
        raise RequestError("'wait_for_shared' must be a boolean", param="wait_for_shared")
    return PrewarmPlan(
        parsed,
        wait_for_shared=wait,
        timeout_s=_number(body, "timeout_s", DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S),
        concurrency=_integer(body, "concurrency", DEFAULT_CONCURRENCY, MAX_CONCURRENCY),
        store_chunk_tokens=_integer(body, "store_chunk_tokens", DEFAULT_STORE_CHUNK_TOKENS, 1 << 20),
    )


def _shared_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The fields every document's body carries: model, tenant salt and kvmesh controls."""
    shared: dict[str, Any] = {}
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise RequestError("'model' must be a non-empty string", param="model")
        shared["model"] = model
    salt = body.get(CACHE_SALT_FIELD)
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise RequestError(f"'{CACHE_SALT_FIELD}' must be a non-empty string", param=CACHE_SALT_FIELD)
        shared[CACHE_SALT_FIELD] = salt
    controls = body.get(KVMESH_FIELD)
    if controls is not None:
        if not isinstance(controls, dict):
            raise RequestError(f"'{KVMESH_FIELD}' must be an object", param=KVMESH_FIELD)
        shared[KVMESH_FIELD] = controls
    return shared


def _document(i: int, doc: Any, shared: dict[str, Any]) -> PrewarmDocument:
    where = f"documents[{i}]"
    if not isinstance(doc, dict):
        raise RequestError(f"{where} must be an object, got {type(doc).__name__}", param="documents")
    unknown = sorted(set(doc) - _DOCUMENT_FIELDS)
    if unknown:
        raise RequestError(
            f"{where} has unknown fields {unknown} (expected {sorted(_DOCUMENT_FIELDS)})", param="documents"
        )
    doc_id = doc.get("id", str(i))
    if isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or doc_id == "":
        raise RequestError(f"{where}.id must be a non-empty string or an integer", param="documents")
    given = [f for f in _CONTENT_FIELDS if f in doc]
    if len(given) != 1:
        raise RequestError(
            f"{where} needs exactly one of 'prompt', 'messages' or 'prompt_token_ids', got {given or 'none'}",
            param="documents",
        )
    content = doc[given[0]]
    body: dict[str, Any] = dict(shared)
    controls = doc.get(KVMESH_FIELD)
    if controls is not None:
        if not isinstance(controls, dict):
            raise RequestError(f"{where}.{KVMESH_FIELD} must be an object", param="documents")
        body[KVMESH_FIELD] = controls
    if given[0] == "prompt":
        if not isinstance(content, str) or not content:
            raise RequestError(f"{where}.prompt must be a non-empty string", param="documents")
        body["prompt"] = content
        return PrewarmDocument(str(doc_id), body, chat=False)
    if given[0] == "prompt_token_ids":
        if not isinstance(content, list) or not content:
            raise RequestError(f"{where}.prompt_token_ids must be a non-empty list", param="documents")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in content):
            raise RequestError(f"{where}.prompt_token_ids must hold integers in [0, 2^32)", param="documents")
        body["prompt"] = content
        return PrewarmDocument(str(doc_id), body, chat=False)
    if not isinstance(content, list) or not content:
        raise RequestError(f"{where}.messages must be a non-empty list", param="documents")
    body["messages"] = content
    return PrewarmDocument(str(doc_id), body, chat=True)


def _number(body: dict[str, Any], name: str, default: float, maximum: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= maximum:
        raise RequestError(f"'{name}' must be a number in (0, {maximum:g}], got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int, maximum: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise RequestError(f"'{name}' must be an integer in [1, {maximum}], got {value!r}", param=name)
    return value
