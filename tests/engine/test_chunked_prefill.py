"""Long prompts are prefilled in chunks between the running requests' steps, with the same result as alone."""

from __future__ import annotations

import torch

from specserve.engine import engine as engine_module
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.engine.sequence import PREFILL_CHUNK
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

from tests.engine.test_batching import PROMPTS, run_batched


def long_prompt(length: int, seed: int = 0) -> list[int]:
    """Token ids of a prompt that repeats itself (so n-gram drafts find matches), clear of the special ids."""
    generator = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 380, (37,), generator=generator).tolist()
    return [1] + (motif * (length // len(motif) + 1))[: length - 1]


def test_a_long_prompt_gives_the_same_output_batched_as_alone(loaded):
    engine = Engine(loaded("qwen3"), NGramMethod(1, 3), 4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = [(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True)), (long_prompt(300), params),
                (PROMPTS[1], params), (long_prompt(3 * PREFILL_CHUNK, seed=1), params)]
    alone = [engine.generate(prompt, p).token_ids for prompt, p in requests]
    batched = run_batched(BatchEngine(engine, max_batch_size=4), requests)
    assert [batched[i].token_ids for i in range(len(requests))] == alone


def test_chunks_compute_what_one_piece_computes(loaded, monkeypatch):
    """The chunks' positions, slots and masks are right: the output is the one-piece prefill's (fp32, up to
    rounding, so compared on logits with a tolerance and on greedy tokens)."""
    target = loaded("llama")
    prompt = long_prompt(200)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    chunked = Engine(target).generate(prompt, params).token_ids
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 10_000)
    assert Engine(target).generate(prompt, params).token_ids == chunked


def test_running_requests_decode_between_chunks(loaded):
    engine = Engine(loaded("llama"))
    batch = BatchEngine(engine, max_batch_size=2)
    short = batch.add(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    batch.step()  # the short prompt's prefill: it decodes from now on
    long = batch.add(long_prompt(400), SamplingParams(max_tokens=4))
    kinds = []
    while long in batch.waiting or long in batch.prefilling:
        before = len(short.stops.output)
        batch.step()
        kinds.append("decode" if len(short.stops.output) > before else "chunk")
    assert kinds.count("chunk") >= 400 // PREFILL_CHUNK - 1
    assert "chunk,chunk" not in ",".join(kinds)  # a chunk is always paid for by decoding time


def test_a_cancelled_long_prompt_stops_between_chunks(loaded):
    engine = Engine(loaded("llama"))
    batch = BatchEngine(engine, max_batch_size=2)
    seq = batch.add(long_prompt(400), SamplingParams(max_tokens=4))
    batch.step()
    assert seq in batch.prefilling and batch.prefilling.caches[seq].lengths[0] == PREFILL_CHUNK
    batch.cancel(seq)
    assert not batch.has_work() and batch.step() == []
