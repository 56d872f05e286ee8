"""The Kubernetes manifests: schema-valid, lint-clean, and wired the way the router and engines need."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_paths import DEPLOY, OVERLAYS, REPO

from kvmesh.router.config import router_config_from_dict
from kvmesh.store.config import config_from_mapping


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flag(args: list[str], name: str) -> str:
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not among {args}")


def test_every_overlay_passes_the_kubernetes_schemas(
    deploy_python: Path, kubectl: str, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    run = subprocess.run(
        [str(deploy_python), str(DEPLOY / "check_manifests.py"), "--json", str(report)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(report.read_text())
    assert sorted(results) == OVERLAYS
    for overlay, result in results.items():
        assert result["errors"] == [], overlay
        for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "StatefulSet",
                     "ServiceMonitor", "PodMonitor", "NetworkPolicy", "Ingress"):  # fmt: skip
            assert kind in result["kinds"], (overlay, kind)


def test_the_validation_rejects_broken_objects(deploy_python: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replica": 2, "selector": {}, "template": {}},
    }
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "y"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoint": [{"port": "http"}]},
    }
    typo = {"apiVersion": "v1", "kind": "Servic", "metadata": {"name": "z"}}
    broken.write_text(yaml.safe_dump_all([deployment, monitor, typo]))
    run = subprocess.run(
        [str(deploy_python), str(DEPLOY / "check_manifests.py"), "--file", str(broken)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert "Deployment/x" in run.stdout and "replica" in run.stdout
    assert "ServiceMonitor/y" in run.stdout and "endpoints" in run.stdout
    assert "Servic/z" in run.stdout


def test_checkov_finds_nothing_that_is_not_justified(
    deploy_python: Path, kubectl: str, tmp_path: Path
) -> None:
    out = tmp_path / "rendered"
    out.mkdir()
    for overlay in OVERLAYS:
        rendered = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / "kustomize" / "overlays" / overlay)],
            check=True,
            capture_output=True,
            text=True,
        )
        (out / f"{overlay}.yaml").write_text(rendered.stdout)
    checkov = deploy_python.parent / "checkov"
    dockerfiles = [REPO / "Dockerfile", DEPLOY / "vllm" / "Dockerfile", DEPLOY / "vllm" / "Dockerfile.cpu"]
    runs = [
        [str(checkov), "-d", str(out), "--framework", "kubernetes"],
        [str(checkov), *[a for f in dockerfiles for a in ("-f", str(f))], "--framework", "dockerfile"],
    ]
    # checkov runs without deploy/checkov.yaml here, so the accepted findings are seen too: every
    # finding must be one checkov.yaml justifies, and every justification must still be needed.
    accepted = set(yaml.safe_load((DEPLOY / "checkov.yaml").read_text())["skip-check"])
    found: set[str] = set()
    for argv in runs:
        run = subprocess.run([*argv, "--output", "json", "--quiet"], capture_output=True, text=True)
        reports = json.loads(run.stdout)
        for report in reports if isinstance(reports, list) else [reports]:
            assert report["summary"]["passed"] > 0
            failed = report["results"]["failed_checks"]
            unjustified = [(c["check_id"], c["resource"]) for c in failed if c["check_id"] not in accepted]
            assert unjustified == [], unjustified
            found |= {c["check_id"] for c in failed}
    assert found == accepted, accepted - found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_finds_engines_and_shares_its_index(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
):
    docs = rendered[overlay]
    router = _one(docs, "Deployment", "kvmesh-router")
    assert router["spec"]["replicas"] >= 2
    container = _container(router)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    pdb = _one(docs, "PodDisruptionBudget", "kvmesh-router")
    pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    config_map = _one(docs, "ConfigMap", "kvmesh-router-config")
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    config = router_config_from_dict(yaml.safe_load(config_map["data"]["router.yaml"]))
    assert _flag(container["args"], "--config") == "/etc/kvmesh/router.yaml"

    # discovery follows the engines' headless Service, on the engines' HTTP port
    engines = _one(docs, "Deployment", "kvmesh-engines")
    service = _one(docs, "Service", "kvmesh-engines")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= engines["spec"]["template"]["metadata"]["labels"].items()
    (discovery,) = config.discovery
    assert discovery.service == service["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in _container(engines)["ports"]}
    assert discovery.port == ports["http"]

    # both router replicas share one index on the Valkey Service
    assert config.index.backend == "redis" and config.index.redis_url is not None
    valkey = _one(docs, "Service", "kvmesh-valkey")
    url = urlsplit(config.index.redis_url)
    assert url.hostname == valkey["metadata"]["name"] and url.port == valkey["spec"]["ports"][0]["port"]
    assert config.tokenizer and config.policy == "precise"

    env = {e["name"]: e for e in container.get("env", [])}
    ref = env["KVMESH_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("kvmesh-secrets", "admin-token")


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("vllm")])
def test_vllm_pods_publish_events_and_load_the_connector(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    engines = _one(docs, "Deployment", "kvmesh-engines")
    container = _container(engines)
    args = container["args"]
    config = router_config_from_dict(
        yaml.safe_load(_one(docs, "ConfigMap", "kvmesh-router-config")["data"]["router.yaml"])
    )
    (discovery,) = config.discovery
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    events = json.loads(_flag(args, "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # vLLM binds only wildcard endpoints; the router connects to each pod's own address
    assert events["endpoint"] == f"tcp://*:{discovery.events_port}" == f"tcp://*:{ports['kv-events']}"
    assert events["replay_endpoint"] == f"tcp://*:{discovery.replay_port}" == f"tcp://*:{ports['kv-replay']}"
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args

    transfer = json.loads(_flag(args, "--kv-transfer-config"))
    assert transfer["kv_role"] == "kv_both"
    if transfer["kv_connector"] == "OffloadingConnector":
        # vLLM's native offloading, with kvmesh as the secondary tier behind its CPU tier
        extra = transfer["kv_connector_extra_config"]
        assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] > 0
        (tier,) = extra["secondary_tiers"]
        assert tier["type"] == "KVMeshSecondaryTier"
        module, store_path = tier["module_path"], Path(tier["store"])
    else:
        assert transfer["kv_connector"] == "KVMeshConnector"
        assert transfer["kv_load_failure_policy"] == "recompute"
        module = transfer["kv_connector_module_path"]
        store_path = Path(transfer["kv_connector_extra_config"]["store"])
    assert (REPO / "src" / Path(*module.split("."))).with_suffix(".py").is_file()

    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in engines["spec"]["template"]["spec"]["volumes"]}
    store_map = volumes[mounts[str(store_path.parent)]]["configMap"]["name"]
    store_doc = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == store_map)
    store = config_from_mapping(yaml.safe_load(store_doc["data"][store_path.name]), source=store_path.name)
    assert store.ignored_keys == []
    assert store.remote_url is not None and urlsplit(store.remote_url).hostname == "kvmesh-valkey"

    env = {e["name"]: e for e in container["env"]}
    ref = env["KVMESH_HMAC_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("kvmesh-secrets", "hmac-key")
    assert env["PYTHONHASHSEED"]["value"] == "0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitors_select_what_serves_metrics(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    router_service = _one(docs, "Service", "kvmesh-router")
    service_monitor = _one(docs, "ServiceMonitor", "kvmesh-router")
    assert (
        service_monitor["spec"]["selector"]["matchLabels"].items()
        <= router_service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {
        p["name"] for p in router_service["spec"]["ports"]
    }
    engines = _one(docs, "Deployment", "kvmesh-engines")
    pod_monitor = _one(docs, "PodMonitor", "kvmesh-engines")
    labels = engines["spec"]["template"]["metadata"]["labels"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"] for p in _container(engines)["ports"]}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= ports
