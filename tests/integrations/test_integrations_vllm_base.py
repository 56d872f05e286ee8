"""KVMeshConnector on top of a vLLM-shaped base class: the import path taken when vLLM is
installed. A minimal ``vllm`` package with the connector base's contract (abstract methods, the
constructor signatures of newer and older vLLM, metadata binding) is written to a temporary
directory and the connector is loaded against it in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_BASE = """
import enum
from abc import ABC, abstractmethod


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


class KVConnectorBase_V1(ABC):
    INIT
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._role = role

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

LOAD_ERRORS

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abstractmethod
    def wait_for_layer_load(self, layer_name): ...
    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    @abstractmethod
    def wait_for_save(self): ...
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...
    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...
    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...
"""

_SCRIPT = """
import importlib
import pickle
import sys
from types import SimpleNamespace

import torch


def run(root, construct):
    for name in [m for m in sys.modules if m == "vllm" or m.startswith(("vllm.", "kvmesh.integrations.vllm"))]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        connector_module = importlib.import_module("kvmesh.integrations.vllm")
        compat = importlib.import_module("kvmesh.integrations.vllm_compat")
    finally:
        sys.path.remove(root)
    assert compat.HAS_VLLM
    cls = connector_module.KVMeshConnector
    assert issubclass(cls, base.KVConnectorBase_V1)
    model = SimpleNamespace(model="m", served_model_name="m", revision=None, dtype=torch.float16, use_mla=False,
                            get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 4)
    config = SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"store": "memory"},
                                           kv_load_failure_policy="recompute"),
    )
    role = base.KVConnectorRole.WORKER
    try:
        if construct == "three":
            worker = cls(config, role, SimpleNamespace(kv_cache_groups=[object()]))
        else:
            worker = cls(config, role)
    except ValueError as exc:
        return f"REFUSED: {exc}"
    assert worker.role is role
    caches = {f"l{i}": torch.zeros(2, 4, 16, 1, 4, dtype=torch.float16) for i in range(2)}
    worker.register_kv_caches(caches)
    meta = pickle.loads(pickle.dumps(connector_module.KVMeshConnectorMetadata()))
    assert isinstance(meta, base.KVConnectorMetadata)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.shutdown()
    return "OK"


for arg in sys.argv[1:]:
    name, root, construct = arg.split("|")
    print(name, run(root, construct))
"""

_VARIANTS = {
    # base constructor, whether the base has get_block_ids_with_load_errors, how vLLM calls ours
    "kv_cache_config": ("def __init__(self, vllm_config, role, kv_cache_config):", True, "three"),
    "two_arguments": ("def __init__(self, vllm_config, role):", True, "two"),
    "no_load_error_reporting": ("def __init__(self, vllm_config, role):", False, "two"),
}


def _fake_vllm(root: Path, init: str, load_errors: bool) -> None:
    pkg = root / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    pkg.mkdir(parents=True)
    for d in [pkg, *pkg.parents]:
        if d == root:
            break
        (d / "__init__.py").touch()
    method = "    def get_block_ids_with_load_errors(self):\n        return set()\n" if load_errors else ""
    (pkg / "base.py").write_text(_BASE.replace("INIT", init).replace("LOAD_ERRORS", method))


def test_connector_against_vllm_shaped_bases(tmp_path: Path) -> None:
    args = []
    for name, (init, load_errors, construct) in _VARIANTS.items():
        _fake_vllm(tmp_path / name, init, load_errors)
        args.append(f"{name}|{tmp_path / name}|{construct}")
    src = Path(__file__).resolve().parents[2] / "src"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["kv_cache_config"] == "OK"
    assert lines["two_arguments"] == "OK"
    assert lines["no_load_error_reporting"].startswith("REFUSED")
    assert "get_block_ids_with_load_errors" in lines["no_load_error_reporting"]
