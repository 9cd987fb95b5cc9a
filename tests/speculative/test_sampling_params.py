"""Sampling parameters are checked at the edge, and no valid setting makes the sampler fail."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.speculative.sampling import SamplingParams, probabilities, sample


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.1), ("temperature", True),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -math.inf),
    ("max_tokens", 0), ("max_tokens", 2.0), ("top_k", 1.5), ("seed", 2**64), ("seed", -2**63 - 1),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop", [""]),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_top_p_that_keeps_nothing_keeps_the_top_token(top_p):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [7.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(temperature=0.5, top_p=top_p)
    params.validate()
    probs = probabilities(logits, params)
    assert torch.equal(probs, torch.eye(4)[[1, 0]])
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [1, 0]
