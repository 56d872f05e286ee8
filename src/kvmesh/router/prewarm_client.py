"""``kvmesh prewarm``: read documents from files and prewarm them through a router.

Inputs, one or more of:

- ``*.jsonl``: one document per line, ``{"id", "prompt" | "messages" | "prompt_token_ids"}``
  (optionally ``"kvmesh": {...}``);
- any other file: its text is one document, named by its path;
- a directory: each regular file in it (sorted, hidden ones skipped) is one text document.

``--template "…{document}…"`` wraps every text document (not JSONL ones) into the prompt the
application will send, so the prewarmed prefix is the one its requests start with.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvmesh.core.tenancy import TENANT_HEADER
from kvmesh.router.prewarm import PREWARM_PATH
from kvmesh.router.prewarm_request import (
    FAILED_STATUSES,
    KVMESH_FIELD,
    PrewarmResponse,
    PrewarmResult,
    summarize,
)

TEMPLATE_FIELD = "{document}"
_CONTENT_FIELDS = ("prompt", "messages", "prompt_token_ids")


def load_documents(paths: Sequence[str | Path], template: str | None = None) -> list[dict[str, Any]]:
    """The documents in ``paths``, in order, as prewarm request entries.

    Args:
        paths: JSONL files, text files and directories of text files.
        template: wraps each text document; must contain ``{document}``.

    Raises:
        ValueError: a path is missing, a JSONL line is not a document, a text file is empty or not
            UTF-8, a template lacks ``{document}``, or two documents share an id.
    """
    if template is not None and TEMPLATE_FIELD not in template:
        raise ValueError(f"--template must contain {TEMPLATE_FIELD}, got {template!r}")
    docs: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
            if not files:
                raise ValueError(f"{path}: no documents in this directory")
            docs += [_text_document(f, template) for f in files]
        elif path.suffix == ".jsonl":
            docs += _jsonl_documents(path)
        elif path.is_file():
            docs.append(_text_document(path, template))
        else:
            raise ValueError(f"{path}: no such file or directory")
    seen: set[str] = set()
    for doc in docs:
        if doc["id"] in seen:
            raise ValueError(f"two documents have the id {doc['id']!r}")
        seen.add(doc["id"])
    return docs


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _text_document(path: Path, template: str | None) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from exc
    if not text.strip():
        raise ValueError(f"{path}: empty document")
    prompt = text if template is None else template.replace(TEMPLATE_FIELD, text)
    return {"id": str(path), "prompt": prompt}


def _jsonl_documents(path: Path) -> list[dict[str, Any]]:
    docs = []
    with path.open(encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from exc
            if not isinstance(doc, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(doc).__name__}")
            given = [f for f in _CONTENT_FIELDS if f in doc]
            if len(given) != 1:
                raise ValueError(f"{where}: needs exactly one of {', '.join(_CONTENT_FIELDS)}")
            unknown = sorted(set(doc) - {"id", KVMESH_FIELD, *_CONTENT_FIELDS})
            if unknown:
                raise ValueError(f"{where}: unknown fields {unknown}")
            doc_id = doc.get("id", where)
            if isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or doc_id == "":
                raise ValueError(f"{where}: 'id' must be a non-empty string or an integer")
            docs.append({**doc, "id": str(doc_id)})
    return docs


@dataclass(slots=True)
class PrewarmOptions:
    """How to prewarm (the CLI's flags).

    Attributes:
        url: the router's base URL.
        model: the model (or LoRA adapter) name requests use.
        tenant: sent as ``x-tenant-id``.
        ttl_s: ``kvmesh.cache_ttl_s`` of every document (a pin; ``None``: none).
        batch: documents per request to the router.
        concurrency: documents the router computes at once.
        wait_for_shared: wait for the shared tier (else report once computed).
        timeout_s: the router's wait per document for the shared tier.
        store_chunk_tokens: the store's chunk size.
        http_timeout_s: total time one request to the router may take.
    """

    url: str
    model: str | None = None
    tenant: str | None = None
    ttl_s: float | None = None
    batch: int = 16
    concurrency: int = 4
    wait_for_shared: bool = True
    timeout_s: float = 60.0
    store_chunk_tokens: int = 256
    http_timeout_s: float = 3600.0

    def request_body(self, documents: list[dict[str, Any]]) -> dict[str, Any]:
        """The prewarm request for one batch of ``documents``."""
        body: dict[str, Any] = {
            "documents": documents,
            "wait_for_shared": self.wait_for_shared,
            "timeout_s": self.timeout_s,
            "concurrency": self.concurrency,
            "store_chunk_tokens": self.store_chunk_tokens,
        }
        if self.model is not None:
            body["model"] = self.model
        if self.ttl_s is not None:
            body[KVMESH_FIELD] = {"cache_ttl_s": self.ttl_s}
        return body

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.tenant is not None:
            headers[TENANT_HEADER] = self.tenant
        return headers


async def prewarm_documents(
    documents: list[dict[str, Any]],
    options: PrewarmOptions,
    on_batch: Callable[[list[PrewarmResult]], None] | None = None,
) -> PrewarmResponse:
    """Send ``documents`` to the router in batches, one batch after the other.

    A batch the router refuses (4xx/5xx) or cannot be sent counts each of its documents as
    ``failed``, with the router's message; the other batches still run.

    Args:
        documents: prewarm entries (see :func:`load_documents`).
        options: the router and the prewarm settings.
        on_batch: called with each batch's results as it completes (progress).
    """
    if options.batch < 1:
        raise ValueError(f"batch must be >= 1, got {options.batch}")
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: list[PrewarmResult] = []
    url = options.url.rstrip("/") + PREWARM_PATH
    timeout = aiohttp.ClientTimeout(total=options.http_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(0, len(documents), options.batch):
            batch = documents[i : i + options.batch]
            got = await _send_batch(session, url, batch, options)
            results += got
            if on_batch is not None:
                on_batch(got)
    return PrewarmResponse(documents=results, summary=summarize(results, loop.time() - started))


async def _send_batch(
    session: aiohttp.ClientSession, url: str, batch: list[dict[str, Any]], options: PrewarmOptions
) -> list[PrewarmResult]:
    try:
        async with session.post(
            url, data=msgspec.json.encode(options.request_body(batch)), headers=options.headers()
        ) as resp:
            raw = await resp.read()
            if resp.status == 200:
                return msgspec.json.decode(raw, type=PrewarmResponse).documents
            error = f"the router answered {resp.status}: {_error_message(raw)}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = f"the router could not be reached: {exc or type(exc).__name__}"
    except msgspec.DecodeError as exc:
        error = f"the router's answer is not a prewarm report: {exc}"
    return [PrewarmResult(id=doc["id"], status="failed", error=error) for doc in batch]


def _error_message(raw: bytes) -> str:
    try:
        return str(msgspec.json.decode(raw)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return raw[:300].decode(errors="replace")


def num_failed(response: PrewarmResponse) -> int:
    """Documents not prewarmed (failed, or not in the shared tier in time)."""
    return sum(r.status in FAILED_STATUSES for r in response.documents)


def report_table(response: PrewarmResponse) -> Any:
    """A rich table of ``response``: one row per document and a totals row."""
    from rich.table import Table

    table = Table(title="kvmesh prewarm", show_footer=False)
    for name, justify in (
        ("document", "left"), ("status", "left"), ("tokens", "right"), ("blocks new", "right"),
        ("cached", "right"), ("tiers", "left"), ("shared tokens", "right"), ("endpoint", "left"),
        ("s", "right"),
    ):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    style = {"prewarmed": "green", "cached": "cyan", "timeout": "yellow", "failed": "red"}
    for r in response.documents:
        tiers = " ".join(f"{tier}:{n}" for tier, n in r.tiers.items()) or "-"
        shared = f"{r.shared_tokens}/{r.shared_target_tokens}" if r.shared_target_tokens else "-"
        status = f"[{style.get(r.status, 'white')}]{r.status}[/]"
        if r.error:
            status += f"\n[dim]{r.error}[/]"
        table.add_row(
            r.id, status, str(r.tokens), str(r.blocks_new), str(r.blocks_cached), tiers, shared,
            r.endpoint or "-", f"{r.seconds:.2f}",
        )  # fmt: skip
    s = response.summary
    table.caption = (
        f"{s.documents} documents: {s.prewarmed} prewarmed, {s.cached} already cached, "
        f"{s.timeout} timed out, {s.failed} failed; {s.tokens} tokens, {s.blocks_new} blocks computed, "
        f"{s.seconds:.1f}s"
    )
    return table
