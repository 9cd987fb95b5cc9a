"""A request's metrics: drafted and undrafted steps as the engine records them."""

from __future__ import annotations

from specserve.engine.engine import Engine
from specserve.engine.request import RequestMetrics
from specserve.speculative.sampling import SamplingParams


def test_steps_are_drafted_or_undrafted_after_the_first():
    metrics = RequestMetrics()
    metrics.record_step(0, 0)  # the step after the prefill: nothing could have been drafted
    assert (metrics.drafted_steps, metrics.undrafted_steps) == (0, 0)
    metrics.record_step(3, 2, 3)
    metrics.record_step(0, 0)
    metrics.record_step(0, 0)
    metrics.record_step(2, 0, 1)
    assert (metrics.drafted_steps, metrics.undrafted_steps) == (2, 2)
    assert metrics.to_dict()["undrafted_steps"] == 2


def test_an_engine_request_counts_every_decoding_step_once(loaded):
    from specserve.speculative.ngram import NGramMethod

    target = loaded("llama")
    repeating = "one two three four one two three four one two three four one two"
    engine = Engine(target, NGramMethod(1, 3), 4)
    metrics = engine.generate(repeating, SamplingParams(max_tokens=24)).metrics
    assert metrics.drafted_steps > 0
    assert metrics.drafted_steps + metrics.undrafted_steps == metrics.target_forwards - 1
    plain = Engine(target).generate(repeating, SamplingParams(max_tokens=24)).metrics
    assert plain.drafted_steps == 0 and plain.undrafted_steps == plain.target_forwards - 1 > 0
