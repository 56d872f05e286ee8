"""Sampling rules: greedy argmax, seeded draws, nucleus truncation, range checks."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.runner import SamplingParams
from kvmesh.engine.sampling import make_generator, sample_token, validate_sampling


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    params = SamplingParams(temperature=0.0)
    assert make_generator(params) is None
    assert sample_token(logits, params, None) == 1


def test_seed_fixes_the_draws() -> None:
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0, seed=3)
    g1, g2 = make_generator(params), make_generator(params)
    draws1 = [sample_token(logits, params, g1) for _ in range(20)]
    draws2 = [sample_token(logits, params, g2) for _ in range(20)]
    assert draws1 == draws2
    assert len(set(draws1)) > 5
    other = make_generator(SamplingParams(temperature=1.0, seed=4))
    assert [sample_token(logits, params, other) for _ in range(20)] != draws1


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    g = make_generator(params)
    assert {sample_token(logits, params, g) for _ in range(300)} == {0, 1}
    tiny = SamplingParams(temperature=1.0, top_p=0.01, seed=0)
    g = make_generator(tiny)
    assert {sample_token(logits, tiny, g) for _ in range(50)} == {0}


def test_low_temperature_concentrates() -> None:
    logits = torch.tensor([1.0, 1.5, 0.0])
    params = SamplingParams(temperature=0.05, seed=1)
    g = make_generator(params)
    assert {sample_token(logits, params, g) for _ in range(100)} == {1}


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=2.5), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_out_of_range_values_are_refused(params: SamplingParams, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_sampling(params)
    validate_sampling(SamplingParams(temperature=2.0, top_p=1.0, max_tokens=1))


def test_one_row_only() -> None:
    with pytest.raises(ValueError, match="one logits row"):
        sample_token(torch.zeros(2, 3), SamplingParams(), None)
