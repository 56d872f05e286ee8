"""Tiny LoRA adapters for the interop tests, written from random weights in PEFT's on-disk format.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with one
``lora_A`` (rank x in) and ``lora_B`` (out x rank) pair per targeted projection, which is all vLLM
reads. Weights are random but seeded, so each adapter changes the base model's output in its own
way; ``lora_B`` is non-zero (PEFT initialises it to zero, which would make the adapter a no-op).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TARGET_MODULES = ("q_proj", "v_proj")


def make_random_lora(model_dir: Path, out_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """Write a rank-``rank`` LoRA on ``q_proj`` and ``v_proj`` of every layer of the model in
    ``model_dir`` into ``out_dir``.

    Returns:
        ``out_dir``, ready for ``--lora-modules name=out_dir``.
    """
    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    out_features = {
        "q_proj": heads * head_dim,
        "v_proj": int(config.get("num_key_value_heads") or heads) * head_dim,
    }
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, hidden)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (out_features[module], rank)).astype(
                np.float32
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir
