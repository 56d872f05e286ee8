"""kvmesh against live vLLM servers: the connector shares KV between them, the router reads their
KV events (128-token blocks on CPU) and routes repeats to the holder, and a restarted router
rebuilds its index from vLLM's replay socket."""

from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from interop_helpers import LiveVllm, complete, http_json, kvmesh_command, metric, stop, wait_healthy
from store_hosts import SlowLink

from kvmesh.core.hashing import Namespace
from kvmesh.core.net import free_ports
from kvmesh.fleet.process import ManagedProcess
from kvmesh.fleet.vllm import VllmReplica
from kvmesh.integrations.store_bridge import StoreBridge
from kvmesh.store.local_server import LocalServer

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "interop-admin"
WORDS = [
    "river",
    "stone",
    "cloud",
    "garden",
    "lantern",
    "harbor",
    "meadow",
    "pencil",
    "orbit",
    "canyon",
    "violet",
    "marble",
    "thunder",
    "saddle",
    "copper",
    "anchor",
    "willow",
    "falcon",
    "ember",
    "glacier",
]


def text(seed: int, num_words: int) -> str:
    """Deterministic filler text (about three tokens a word with SmolLM2's tokenizer)."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(num_words))


def wait_for_store(bridge: StoreBridge, token_ids: list[int], namespace: Namespace, want: int) -> int:
    """Poll until the store holds ``want`` prefix tokens (saves are written in the background)."""
    deadline = time.monotonic() + 120.0
    found = 0
    while time.monotonic() < deadline:
        found = bridge.lookup(token_ids, namespace)
        if found >= want:
            return found
        time.sleep(0.2)
    return found


def test_second_vllm_loads_what_the_first_computed(
    vllm_pair: list[LiveVllm], valkey: LocalServer, model_dir: Path
) -> None:
    first, second = vllm_pair
    prompt = text(seed=11, num_words=700)
    cold = complete(first.url, prompt)
    assert cold.prompt_tokens >= 2000, cold
    assert cold.cached_tokens == 0
    whole_chunks = cold.prompt_tokens // 256 * 256
    token_ids = http_json(f"{first.url}/tokenize", {"model": "smollm2", "prompt": prompt})["tokens"]
    assert len(token_ids) == cold.prompt_tokens
    bridge = StoreBridge(valkey.url, lookup_timeout_s=2.0)
    try:
        stored = wait_for_store(bridge, token_ids, first.replica.store_namespace(), whole_chunks)
    finally:
        bridge.close()
    assert stored >= whole_chunks, (
        f"the store holds {stored} of {whole_chunks} tokens of the first server's prompt"
    )

    external_before = metric(second.url, "vllm:external_prefix_cache_hits_total")
    warm = complete(second.url, prompt)
    external = metric(second.url, "vllm:external_prefix_cache_hits_total") - external_before
    assert warm.cached_tokens >= 0.9 * whole_chunks, (warm, whole_chunks)
    assert external == warm.cached_tokens  # vLLM's own metric counts kvmesh's load as external hits
    assert warm.text == cold.text  # greedy first token identical to the cold run
    # the load (over 64 MiB of float32 KV) ran off vLLM's step, reported through finished_recving
    assert "first background load" in second.proc.log_path.read_text()


def test_a_slow_store_is_waited_for_not_recomputed(
    vllm_pair: list[LiveVllm], valkey: LocalServer, model_dir: Path, tmp_path: Path
) -> None:
    """A server whose store answers each round trip 0.15 s late (three times the connector's 0.05 s
    per-step wait) still loads the prompt: its lookup spans scheduler steps instead of missing.
    (Not slower: the store's own 1 s tier timeout covers the new connection's handshakes too.)"""
    first, _ = vllm_pair
    prompt = text(seed=23, num_words=700)
    cold = complete(first.url, prompt)
    whole_chunks = cold.prompt_tokens // 256 * 256
    token_ids = http_json(f"{first.url}/tokenize", {"model": "smollm2", "prompt": prompt})["tokens"]
    bridge = StoreBridge(valkey.url, lookup_timeout_s=2.0)
    try:
        assert (
            wait_for_store(bridge, token_ids, first.replica.store_namespace(), whole_chunks) >= whole_chunks
        )
    finally:
        bridge.close()
    link = SlowLink(("127.0.0.1", valkey.port), delay_s=0.15)
    port, events_port, replay_port = free_ports(3)
    replica = VllmReplica(
        name="vllm-slow-store",
        port=port,
        events_port=events_port,
        replay_port=replay_port,
        model_dir=model_dir,
        store=link.url,
        cpu_core=0,
        max_model_len=8192,
    )
    slow = LiveVllm(
        replica, ManagedProcess(replica.name, replica.argv(), tmp_path / "vllm.log", env=replica.env())
    )
    slow.proc.start()
    try:
        wait_healthy(slow)
        warm = complete(slow.url, prompt)
        assert warm.cached_tokens >= 0.9 * whole_chunks, (warm, whole_chunks)
        assert warm.text == cold.text
    finally:
        stop(slow.proc)
        link.close()


# ---------------------------------------------------------------- router in front of vLLM


def router_config(path: Path, port: int, servers: list[LiveVllm], model_dir: Path, policy: str) -> Path:
    endpoints = [
        {
            "url": s.url,
            "eventsEndpoint": s.replica.events_endpoint,
            "replayEndpoint": s.replica.replay_endpoint,
        }
        for s in servers
    ]
    config = {
        "host": "127.0.0.1",
        "port": port,
        "model": "smollm2",
        "tokenizer": str(model_dir),
        "adminToken": ADMIN_TOKEN,
        "policy": policy,
        "seed": 7,
        "endpoints": endpoints,
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def admin_index(router_url: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{router_url}/admin/index", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def admin_endpoints(router_url: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        f"{router_url}/admin/endpoints", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        endpoints: list[dict[str, Any]] = json.loads(resp.read())["endpoints"]
    return endpoints


def logged_kv_capacity(server: LiveVllm) -> int:
    """The KV capacity in tokens vLLM logged at startup ("CPU KV cache size: 23,296 tokens")."""
    found = re.search(r"KV cache size: ([\d,]+) tokens", server.proc.log_path.read_text())
    assert found is not None, server.proc.log_tail(40)
    return int(found.group(1).replace(",", ""))


def start_router(config: Path, log: Path, port: int) -> ManagedProcess:
    proc = ManagedProcess("router", kvmesh_command("router", "--config", str(config)), log)
    proc.start()
    deadline = time.monotonic() + 60
    while True:
        proc.check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.3)


def indexed_blocks(body: dict[str, Any]) -> int:
    return int(sum(pod.get("blocks") or 0 for pod in body.get("pods", {}).values()))


@pytest.fixture(scope="module")
def router(
    vllm_pair: list[LiveVllm], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    run = tmp_path_factory.mktemp("router")
    port = free_ports(1)[0]
    config = router_config(run / "router.yaml", port, vllm_pair, model_dir, "precise")
    proc = start_router(config, run / "router.log", port)
    state: dict[str, Any] = {
        "url": f"http://127.0.0.1:{port}",
        "proc": proc,
        "config": config,
        "run": run,
        "port": port,
    }
    try:
        yield state
    finally:
        stop(state["proc"])


def group_prompts(seed: int, groups: int, repeats: int) -> list[tuple[int, str]]:
    """(group, prompt) in group-major order: a ~700-token shared prefix, then a short question."""
    out = []
    for g in range(groups):
        prefix = text(seed * 1000 + g, 230)
        for r in range(repeats):
            out.append((g, f"{prefix}\nQuestion {r}: {text(seed * 7919 + g * 31 + r, 8)}?"))
    return out


def fleet_hits(servers: list[LiveVllm]) -> tuple[float, float]:
    return (
        sum(metric(s.url, "vllm:prefix_cache_hits_total") for s in servers),
        sum(metric(s.url, "vllm:prefix_cache_queries_total") for s in servers),
    )


def test_router_routes_repeats_to_the_holder_and_beats_round_robin(
    vllm_pair: list[LiveVllm], router: dict[str, Any]
) -> None:
    groups, repeats = 3, 3
    # Round-robin over the same servers (vLLM's own prefix cache): each group's repeats alternate.
    hits0, queries0 = fleet_hits(vllm_pair)
    for i, (_, prompt) in enumerate(group_prompts(seed=1, groups=groups, repeats=repeats)):
        complete(vllm_pair[i % 2].url, prompt)
    hits1, queries1 = fleet_hits(vllm_pair)
    round_robin = (hits1 - hits0) / (queries1 - queries0)

    holders: dict[int, str] = {}
    for group, prompt in group_prompts(seed=2, groups=groups, repeats=repeats):
        result = complete(router["url"], prompt)
        assert result.endpoint is not None
        if group in holders:
            assert result.endpoint == holders[group], f"repeat of group {group} left its holder"
        else:
            holders[group] = result.endpoint
        time.sleep(0.3)  # the prefill's BlockStored events reach the router
    hits2, queries2 = fleet_hits(vllm_pair)
    routed = (hits2 - hits1) / (queries2 - queries1)
    assert routed > round_robin, (routed, round_robin)

    body = admin_index(router["url"])
    assert body["ingest"]["num_blocks_stored"] > 0
    assert {pod["block_size"] for pod in body["pods"].values() if pod.get("block_size")} == {128}
    # each vLLM's KV capacity, read from its vllm:cache_config_info, is what it logged at startup
    logged = {s.url: logged_kv_capacity(s) for s in vllm_pair}
    assert all(tokens > 0 for tokens in logged.values()), logged
    assert {e["pod"]: e["kv_capacity_tokens"] for e in admin_endpoints(router["url"])} == logged
    router["holders"] = holders


def test_restarted_router_rebuilds_its_index_from_vllm_replay(
    vllm_pair: list[LiveVllm], router: dict[str, Any]
) -> None:
    if "holders" not in router:  # run alone: make the router learn a few prefixes (batches) first
        router["holders"] = {
            group: complete(router["url"], prompt).endpoint
            for group, prompt in group_prompts(seed=2, groups=3, repeats=1)
        }
        time.sleep(0.3)
    before = indexed_blocks(admin_index(router["url"]))
    assert before > 0
    stop(router["proc"])
    router["proc"] = start_router(router["config"], router["run"] / "router-restarted.log", router["port"])
    deadline = time.monotonic() + 5.0
    rebuilt = 0
    while time.monotonic() < deadline:
        rebuilt = indexed_blocks(admin_index(router["url"]))
        if rebuilt >= before:
            break
        time.sleep(0.1)
    assert rebuilt >= before, f"{rebuilt} of the {before} blocks replayed from vLLM's replay socket in 5 s"
    body = admin_index(router["url"])
    assert body["subscriber"]["num_replayed"] > 0
    assert body["subscriber"]["num_malformed"] == 0
    # The rebuilt index routes a new question on a known prefix to the replica that holds it.
    _, repeat = group_prompts(seed=2, groups=1, repeats=4)[3]
    assert complete(router["url"], repeat).endpoint == router["holders"][0]


def test_router_reports_vllms_cached_tokens_and_says_when_a_stream_header_is_a_prediction(
    vllm_pair: list[LiveVllm], router: dict[str, Any]
) -> None:
    prompt = group_prompts(seed=3, groups=1, repeats=1)[0][1]
    url = f"{router['url']}/v1/completions"

    def post(stream: bool) -> tuple[dict[str, str], dict[str, Any], str]:
        body: dict[str, Any] = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            header = dict(item.split("=", 1) for item in resp.headers["x-kvmesh-cache"].split(";"))
            raw = resp.read()
            rid = resp.headers["x-request-id"]
        if not stream:
            return header, json.loads(raw)["usage"], rid
        lines = [json.loads(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: {")]
        return header, next(c["usage"] for c in lines if c.get("usage")), rid

    header, usage, _ = post(stream=False)
    assert header["cached"] == str(usage["prompt_tokens_details"]["cached_tokens"])
    time.sleep(0.5)  # the prefill's BlockStored events reach the router
    header, usage, _ = post(stream=False)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and header["cached"] == str(cached) and "predicted" not in header
    assert header["reason"] == "partial_block"  # vLLM computes the 128-token block holding the last token
    header, usage, rid = post(stream=True)
    assert header["predicted"] == "1"  # vLLM sends its usage last: the header is the router's prediction
    req = urllib.request.Request(
        f"{router['url']}/admin/explain/{rid}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        explained = json.loads(resp.read())
    assert explained["verdict"]["predicted"] is False
    assert explained["verdict"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == cached
