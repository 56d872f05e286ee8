"""How kvmesh starts real vLLM replicas: flags, environment, the connector's namespace."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.fleet.vllm import VllmReplica
from kvmesh.integrations.vllm_format import ModelKVFormat


def replica(tmp_path: Path, **kw: object) -> VllmReplica:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30}
        )
    )
    return VllmReplica(name="vllm-0", port=8100, model_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_events_bind_every_interface_and_are_read_on_loopback(tmp_path: Path) -> None:
    r = replica(tmp_path, events_port=5601, replay_port=5602)
    events = json.loads(r.argv()[r.argv().index("--kv-events-config") + 1])
    # vLLM binds only wildcard/ipc endpoints; tcp://127.0.0.1 would make it connect instead.
    assert events["endpoint"] == "tcp://*:5601" and events["replay_endpoint"] == "tcp://*:5602"
    assert (r.events_endpoint, r.replay_endpoint) == ("tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602")


def test_connector_recomputes_failed_loads_and_is_off_without_a_store(tmp_path: Path) -> None:
    assert "--kv-transfer-config" not in replica(tmp_path).argv()
    r = replica(tmp_path, store="valkey://127.0.0.1:7000/0", connector_extra=(("tenant", "acme"),))
    transfer = json.loads(r.argv()[r.argv().index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVMeshConnector"
    assert transfer["kv_load_failure_policy"] == "recompute"  # vLLM 0.32 defaults to "fail"
    assert transfer["kv_connector_extra_config"] == {"store": "valkey://127.0.0.1:7000/0", "tenant": "acme"}


def test_environment_is_offline_seeded_and_bound(tmp_path: Path) -> None:
    env = replica(tmp_path, cpu_core=1, dev_mode=True).env({"OMP_NUM_THREADS": "1", "PATH": "/bin"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONHASHSEED"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "OMP_NUM_THREADS" not in env and env["PATH"] == "/bin"


def test_store_namespace_matches_the_connector_key_layout(tmp_path: Path) -> None:
    ns = replica(tmp_path).store_namespace()
    assert (ns.model, ns.kv_dtype, ns.kv_layout) == ("smollm2", "float32", "L30xH3xD64")
    assert ns.kv_layout == ModelKVFormat("float32", 30, 3, 64).layout_name()  # the connector's own rule


def test_router_of_kvmesh_engines_tokenizes_with_their_model(tmp_path: Path) -> None:
    from kvmesh.fleet import Fleet, FleetConfig

    argv = Fleet(FleetConfig(num_engines=2, model="smollm2", run_dir=tmp_path))._router_argv(
        8080, "precise", None
    )
    assert argv[argv.index("--tokenizer") + 1] == "smollm2"
    own = FleetConfig(num_engines=2, run_dir=tmp_path, router_args=["--tokenizer", "/models/x"])
    argv = Fleet(own)._router_argv(8080, "precise", None)
    assert argv.count("--tokenizer") == 1 and argv[-1] == "/models/x"
