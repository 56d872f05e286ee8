"""Next-token sampling from one logits row: greedy, or temperature with top-p (nucleus).

Sampling always runs on CPU in float32 with a per-request ``torch.Generator``, so a request with a
``seed`` draws the same tokens on any device and regardless of what else shares its batch.
"""

from __future__ import annotations

import secrets

import torch

from kvmesh.engine.runner import SamplingParams

GREEDY_EPSILON = 1e-5
"""Temperatures at or below this are greedy (OpenAI allows 0; dividing by it is meaningless)."""


def validate_sampling(params: SamplingParams) -> None:
    """Check ranges (OpenAI's): ``0 <= temperature <= 2``, ``0 < top_p <= 1``, ``max_tokens >= 1``.

    Raises:
        ValueError: a value is out of range, with the value in the message.
    """
    if not 0.0 <= params.temperature <= 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= GREEDY_EPSILON


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's random stream: seeded from ``params.seed``, else from the OS; ``None`` if greedy."""
    if is_greedy(params):
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw the next token from a 1-D logits row.

    Args:
        logits: shape (vocab,), any float dtype, any device.
        params: temperature 0 means argmax; otherwise logits / temperature, then the smallest set of
            most likely tokens whose probability mass reaches ``top_p``, then one multinomial draw.
        generator: from :func:`make_generator`; required unless greedy.

    Returns:
        The token id.
    """
    if logits.dim() != 1:
        raise ValueError(f"sample_token takes one logits row, got shape {tuple(logits.shape)}")
    row = logits.detach().to(device="cpu", dtype=torch.float32)
    if is_greedy(params):
        return int(torch.argmax(row).item())
    assert generator is not None, "non-greedy sampling needs the request's generator (make_generator)"
    probs = torch.softmax(row / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(mass_before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
