"""Endpoint pool pieces: URL normalization, Prometheus parsing, config files, the CLI."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest
from router_fakes import free_port

from kvmesh.errors import ConfigError
from kvmesh.router.config import load_router_config, router_config_from_dict
from kvmesh.router.endpoints import _reachable, normalize_url
from kvmesh.router.exposition import parse_prometheus_gauges


def test_normalize_url():
    assert normalize_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert normalize_url(" https://pod-3.svc:443/v ") == "https://pod-3.svc:443/v"
    for bad in ("127.0.0.1:8000", "ftp://x:1", "http://"):
        with pytest.raises(ConfigError, match="http://host:port"):
            normalize_url(bad)


def test_wildcard_event_hosts_take_the_endpoint_host():
    pod = normalize_url("http://10.1.2.3:8000")
    assert _reachable("tcp://*:5557", pod) == "tcp://10.1.2.3:5557"
    assert _reachable("tcp://0.0.0.0:5557", pod) == "tcp://10.1.2.3:5557"
    assert _reachable("tcp://10.9.9.9:5557", pod) == "tcp://10.9.9.9:5557"
    assert _reachable("ipc:///tmp/ev", pod) == "ipc:///tmp/ev"
    assert _reachable(None, pod) is None


def test_prometheus_gauges_sum_over_labels_and_skip_junk():
    text = """# HELP vllm:num_requests_waiting Waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a",engine="0"} 3.0
vllm:num_requests_waiting{model_name="a",engine="1"} 2.0
vllm:kv_cache_usage_perc{model_name="a"} 0.25
vllm:num_requests_running 7
garbage line without value
weird{label="x y"} notanumber
"""
    g = parse_prometheus_gauges(text)
    assert g["vllm:num_requests_waiting"] == 5.0
    assert g["vllm:kv_cache_usage_perc"] == 0.25
    assert g["vllm:num_requests_running"] == 7.0
    assert "weird" not in g


def test_prometheus_gauges_skip_non_finite_samples():
    text = (
        "vllm:num_requests_waiting NaN\nvllm:num_requests_running +Inf\nvllm:kv_cache_usage_perc -Inf\nok 1\n"
    )
    g = parse_prometheus_gauges(text)
    assert g == {"ok": 1.0}


def test_router_config_validation(tmp_path):
    cfg = router_config_from_dict(
        {
            "endpoints": [{"url": "http://a:1", "role": "decode", "eventsEndpoint": "tcp://a:5"}],
            "policy": "load",
        }
    )
    assert cfg.endpoints[0].events_endpoint == "tcp://a:5"
    for raw, message in (
        ({"endpoint": []}, "unknown field"),
        ({"blockSize": 0}, "blockSize"),
        ({"hashAlgo": "md5"}, "hashAlgo"),
        ({"index": {"backend": "redis"}}, "redisUrl"),
        ({"index": {"backend": "etcd"}}, "backend"),
        ({"maxAttempts": 0}, "maxAttempts"),
    ):
        with pytest.raises(ConfigError, match=message):
            router_config_from_dict(raw)
    path = tmp_path / "router.yaml"
    path.write_text("port: 9999\nendpoints:\n  - url: http://x:1\nscheduler:\n  plugins: []\n")
    assert load_router_config(path).port == 9999
    path.write_text("port: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_router_config(path)


def test_admin_token_from_environment(monkeypatch):
    monkeypatch.setenv("KVMESH_ROUTER_ADMIN_TOKEN", "envtok")
    assert router_config_from_dict({}).admin_token == "envtok"
    assert router_config_from_dict({"adminToken": "file"}).admin_token == "file"


def test_cli_serves_and_rejects_bad_flags(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "kvmesh", "router", "--policy", "precise"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "no endpoints" in bad.stderr
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh", "router", "--endpoints", f"http://127.0.0.1:{free_port()}",
         "--policy", "round-robin", "--port", str(port), "--model", "m", "--admin-token", "t"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    import urllib.error
    import urllib.request

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                raise AssertionError("health must be 503 with the only endpoint down")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/admin/index", headers={"Authorization": "Bearer t"}
        )
        stats = msgspec.json.decode(urllib.request.urlopen(req, timeout=5).read())
        assert stats["index"]["backend"] == "memory"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_example_router_config_loads_and_builds_a_scheduler():
    from kvmesh.router.scheduler import PRESETS_DIR, Scheduler, load_scheduler_config

    path = PRESETS_DIR / "router-example.yaml"
    cfg = load_router_config(path)
    assert len(cfg.endpoints) == 3 and cfg.endpoints[2].role == "decode"
    assert cfg.scheduler is not None
    Scheduler.from_config(cfg.scheduler)
    assert load_scheduler_config(path)["schedulingProfiles"][0]["name"] == "default"
