"""Synthetic prompts: token ids drawn from a vocabulary range, and text from a fixed word list."""

from __future__ import annotations

import random

from kvmesh.errors import ConfigError

DEFAULT_VOCAB_SIZE = 32_000
DEFAULT_TOKEN_LOW = 100
"""Synthetic token ids start here so that special tokens (BOS, EOS, chat markers) never appear."""


def check_token_range(vocab_size: int, token_low: int) -> None:
    """Raise :class:`ConfigError` unless ``[token_low, vocab_size)`` holds at least one id."""
    if vocab_size <= token_low:
        raise ConfigError(f"vocab_size ({vocab_size}) must exceed token_low ({token_low})")


def synthetic_tokens(
    rng: random.Random, n: int, vocab_size: int, token_low: int = DEFAULT_TOKEN_LOW
) -> list[int]:
    """``n`` token ids drawn uniformly from ``[token_low, vocab_size)``."""
    check_token_range(vocab_size, token_low)
    return [rng.randrange(token_low, vocab_size) for _ in range(n)]


_WORDS = [
    "alpha",
    "bravo",
    "cedar",
    "delta",
    "ember",
    "falcon",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lumen",
    "meadow",
    "nectar",
    "orchid",
    "pebble",
    "quartz",
    "raven",
    "saffron",
    "timber",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
    "anchor",
    "beacon",
    "canyon",
    "dune",
    "estuary",
    "fjord",
    "glacier",
    "heath",
    "island",
    "jetty",
    "knoll",
    "lagoon",
    "mesa",
    "nook",
    "oasis",
    "prairie",
    "quarry",
    "ridge",
    "savanna",
    "tundra",
    "upland",
    "valley",
    "wharf",
]


def synthetic_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` words from a fixed list of plain lowercase words (stable under BPE tokenizers)."""
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))
