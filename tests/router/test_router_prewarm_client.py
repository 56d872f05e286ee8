"""``kvmesh prewarm``: documents read from JSONL, text files and directories; batches sent to a router;
the report and the exit code."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import MODEL, FakeEngine

from kvmesh.cli import main
from kvmesh.router.config import router_config_from_dict
from kvmesh.router.gateway import Gateway
from kvmesh.router.prewarm_client import PrewarmOptions, load_documents, num_failed, prewarm_documents


def test_jsonl_plain_files_and_a_directory_with_a_template(tmp_path: Path) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(
        '{"id": "a", "prompt": "alpha"}\n'
        "\n"
        '{"id": 2, "prompt_token_ids": [1, 2, 3], "kvmesh": {"cache_ttl_s": 5}}\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    plain = tmp_path / "notes.txt"
    plain.write_text("plain text")
    folder = tmp_path / "manuals"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("second")
    (folder / "a.md").write_text("first")
    (folder / "sub" / "c.txt").write_text("third")
    (folder / ".hidden").write_text("skipped")

    docs = load_documents([jsonl, plain, folder], template="Context:\n{document}\nAnswer from the context.")
    assert docs[0] == {"id": "a", "prompt": "alpha"}, "JSONL documents are sent as given"
    assert docs[1] == {"id": "2", "prompt_token_ids": [1, 2, 3], "kvmesh": {"cache_ttl_s": 5}}
    assert docs[2]["id"] == f"{jsonl}:4" and docs[2]["messages"][0]["content"] == "hi"
    assert docs[3] == {"id": str(plain), "prompt": "Context:\nplain text\nAnswer from the context."}
    assert [d["id"] for d in docs[4:]] == [
        str(folder / "a.md"),
        str(folder / "b.md"),
        str(folder / "sub" / "c.txt"),
    ]
    assert docs[4]["prompt"] == "Context:\nfirst\nAnswer from the context."
    assert load_documents([plain]) == [{"id": str(plain), "prompt": "plain text"}]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "docs.jsonl:1: not JSON"),
        ("[1, 2]\n", "docs.jsonl:1: expected a JSON object"),
        ('{"id": "x"}\n', "docs.jsonl:1: needs exactly one of"),
        ('{"prompt": "a", "max_tokens": 3}\n', "unknown fields ['max_tokens']"),
        ('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n', "two documents have the id 'x'"),
        ('{"id": "", "prompt": "a"}\n', "'id' must be a non-empty string"),
    ],
)
def test_a_bad_jsonl_line_is_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=None) as info:
        load_documents([path])
    assert message in str(info.value)


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    (tmp_path / "nothing").mkdir()
    for paths, template, message in [
        ([empty], None, "empty document"),
        ([binary], None, "not UTF-8"),
        ([tmp_path / "missing.txt"], None, "no such file"),
        ([tmp_path / "nothing"], None, "no documents in this directory"),
        ([empty], "no placeholder", "must contain {document}"),
    ]:
        with pytest.raises(ValueError) as info:
            load_documents(paths, template)
        assert message in str(info.value)


async def start_router(engines: list[FakeEngine]) -> tuple[Gateway, TestClient]:
    raw = {"endpoints": [{"url": e.url} for e in engines], "policy": "precise", "model": MODEL}
    gw = Gateway(router_config_from_dict(raw))
    client = TestClient(TestServer(gw.app))
    await client.start_server()
    deadline = time.monotonic() + 10
    while gw.pool is None or not all(s.healthy for s in gw.pool.states()):
        assert time.monotonic() < deadline, "endpoints not healthy"
        await asyncio.sleep(0.05)
    return gw, client


async def test_batches_are_sent_in_turn_and_a_refused_batch_fails_its_documents(engines) -> None:
    es = await engines(2)
    _, client = await start_router(es)
    try:
        docs = [{"id": f"d{i}", "prompt_token_ids": [100 * i + t for t in range(32)]} for i in range(5)]
        docs[3] = {"id": "text", "prompt": "needs a tokenizer"}  # the router has none: its batch is refused
        seen: list[int] = []
        options = PrewarmOptions(
            url=str(client.make_url("")),
            model=MODEL,
            tenant="acme",
            ttl_s=600,
            batch=2,
            wait_for_shared=False,
        )
        response = await prewarm_documents(docs, options, lambda got: seen.append(len(got)))
        assert seen == [2, 2, 1]
        statuses = {r.id: r.status for r in response.documents}
        assert statuses == {
            "d0": "prewarmed",
            "d1": "prewarmed",
            "d2": "failed",
            "text": "failed",
            "d4": "prewarmed",
        }
        refused = next(r for r in response.documents if r.id == "d2")
        assert (
            refused.error is not None and "answered 400" in refused.error and "no tokenizer" in refused.error
        )
        assert num_failed(response) == 2 and response.summary.prewarmed == 3
        sent = [b for e in es for b in e.received]
        assert len(sent) == 3
        assert all(b["kvmesh"] == {"cache_ttl_s": 600} and b["cache_salt"] == "acme" for b in sent)
        assert all(b["model"] == MODEL for b in sent)
    finally:
        await client.close()


async def test_the_cli_prints_a_json_report_and_exits_non_zero_on_a_failed_document(
    engines, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    es = await engines(1)
    _, client = await start_router(es)
    url = str(client.make_url("")).rstrip("/")
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"id": f"g{i}", "prompt_token_ids": [i + 1] * 48}) + "\n" for i in range(3))
    )
    try:
        argv = ["prewarm", "--url", url, "--no-wait", "--json", "--batch", "2", "--ttl-s", "30", str(good)]
        assert await asyncio.to_thread(main, argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert [d["status"] for d in report["documents"]] == ["prewarmed"] * 3
        assert report["summary"]["blocks_new"] == 9

        text = tmp_path / "doc.txt"
        text.write_text("a text document")
        argv = ["prewarm", "--url", url, "--no-wait", str(good), str(text)]
        assert await asyncio.to_thread(main, argv) == 1, "the router has no tokenizer for the text document"
        table = capsys.readouterr().out
        assert "cached" in table and "failed" in table and "kvmesh prewarm" in table

        assert await asyncio.to_thread(main, ["prewarm", "--url", url, str(tmp_path / "missing")]) == 2
        assert "no such file" in capsys.readouterr().err
    finally:
        await client.close()
