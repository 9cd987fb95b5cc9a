"""Suffix decoding: the tries, drafts from the request's own text and from the shared cache, its bounds, scopes and
per-request controls, and losslessness (greedy equality, sampled distribution with a broken control)."""

from __future__ import annotations

import random
import time
import tracemalloc
from collections import Counter

import pytest

from specserve.checks import ConfigError
from specserve.config import SpeculativeConfig, load_model_yaml
from specserve.config_vllm import load_model_json
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine, RequestError
from specserve.speculative.registry import BY_NAME
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.suffix import ResponseCache, SuffixMethod, SuffixTrie
from tests.engine.test_batching import PROMPTS, run_batched
from tests.speculative.test_sampling_lossless import break_the_verifier, exact_joint, follows, seeded_outputs


def draft(proposer, context, max_len=8) -> list[int]:
    return proposer.propose(context, max_len).tokens


def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(3)
    trie.extend([trie.root], [1, 2, 1, 2])
    assert trie.root.get(1).count == 2 and trie.root.get(1).get(2).count == 2
    assert trie.root.get(2).get(1).get(2).count == 1
    assert trie.root.get(1).get(2).get(1).get(2) is None  # depth 4 is beyond the trie
    trie.extend([trie.root], [1, 2, 1, 2], delta=-1)
    assert trie.nodes == 1 and trie.root.kids() == []


def test_own_text_drafts_what_followed_the_longest_useful_match():
    proposer = SuffixMethod(max_tree_depth=8, max_spec_factor=2.0).new_proposer(SamplingParams(), None, 0)
    assert draft(proposer, [1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5, 1]  # matched [1, 2]: 2 x 2 tokens
    assert draft(proposer, [1, 2, 3, 4, 5, 1, 2], max_len=2) == [3, 4]
    fresh = SuffixMethod().new_proposer(SamplingParams(), None, 0)
    assert draft(fresh, [9, 8, 7]) == []  # nothing recurs


def test_incremental_updates_build_the_same_trie_as_one_pass():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    method = SuffixMethod(max_tree_depth=6)
    stepwise = method.new_proposer(SamplingParams(), None, 0)
    for end in range(1, len(tokens) + 1, 3):
        stepwise.propose(tokens[:end], 4)
    stepwise.propose(tokens, 4)
    whole = method.new_proposer(SamplingParams(), None, 0)
    whole.propose(tokens, 4)
    assert stepwise.trie.nodes == whole.trie.nodes
    assert draft(stepwise, tokens) == draft(whole, tokens)


def test_shared_cache_drafts_an_earlier_response_as_a_frequency_ranked_tree():
    method = SuffixMethod(max_tree_depth=16, max_spec_factor=4.0, min_token_prob=0.2)
    for response in ([5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 30, 31]):
        first = method.new_proposer(SamplingParams(), None, 0)
        first.propose([100, 101], 4)
        first.request_finished(response)
    proposal = method.new_proposer(SamplingParams(), None, 0).propose([200, 5, 6], 4)
    # matched [5, 6] in the cache (3 times, always followed by 7): 7 (p 1), 8 (2/3), 9 (2/3), then 30 (1/3), a
    # sibling of 8, best first
    assert proposal.tokens == [7, 8, 9, 30]
    assert proposal.tree.parents.tolist() == [-1, 0, 1, 2, 1]
    strict = SuffixMethod(max_tree_depth=16, max_spec_factor=4.0, min_token_prob=0.5)
    strict.cache.trie, strict.cache.responses = method.cache.trie, method.cache.responses
    assert strict.new_proposer(SamplingParams(), None, 0).propose([200, 5, 6], 4).tokens == [7, 8, 9]


def test_draft_length_follows_the_matched_length():
    method = SuffixMethod(max_tree_depth=32, max_spec_factor=1.0)
    method.cache.add(list(range(10, 30)))
    proposer = method.new_proposer(SamplingParams(), None, 0)
    assert draft(proposer, [1, 10], 16) == [11]  # one token matched: one drafted
    assert draft(proposer, [1, 10, 11, 12, 13], 16) == [14, 15, 16, 17]


def test_the_oldest_responses_are_evicted_whole():
    cache = ResponseCache(max_depth=8, max_requests=2, max_bytes=2**30)
    empty = cache.bytes
    for response in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.add(response)
    assert list(cache.responses.values()) == [[4, 5, 6], [7, 8, 9]]
    assert cache.trie.root.get(1) is None and cache.trie.root.get(4).get(5).get(6).count == 1
    cache.clear()
    assert cache.bytes == empty and cache.trie.nodes == 1


def test_memory_stays_under_the_cap_with_adversarial_streams():
    """Responses that never repeat a token make the most trie nodes per token; the cache's own count and the
    allocations Python measures both stay under the cap after every response."""
    cap = 3 * 2**20
    tracemalloc.start()
    try:
        cache = ResponseCache(max_depth=24, max_requests=10_000, max_bytes=cap)
        base = tracemalloc.get_traced_memory()[0]
        next_token = 1000
        for length in [50, 400, 2000, 3000, 120, 900] * 3:
            response = list(range(next_token, next_token + length))
            next_token += length
            cache.add(response)
            del response
            measured = tracemalloc.get_traced_memory()[0] - base
            assert cache.bytes <= cap
            assert measured <= cap, (measured, cache.bytes)
        assert 0 < len(cache.responses) < 18  # some evicted, the latest kept
    finally:
        tracemalloc.stop()


def test_a_response_larger_than_the_cap_is_not_kept():
    cache = ResponseCache(max_depth=24, max_requests=100, max_bytes=100_000)
    cache.add([1, 2, 3])
    cache.add(list(range(1000, 6000)))
    assert cache.bytes <= 100_000 and list(cache.responses.values()) == []


def finish(method, prompt, output, **params):
    proposer = method.new_proposer(SamplingParams(**params), None, 0)
    proposer.propose(prompt, 4)
    proposer.request_finished(output)


@pytest.mark.parametrize("isolation", ["scope", "opt_out_writer", "opt_out_reader", "no_cache"])
def test_a_request_never_drafts_another_requests_text_when_isolated(isolation):
    secret = [71, 72, 73, 74, 75, 76]
    method = SuffixMethod(max_tree_depth=16, max_spec_factor=4.0,
                          cache_scope="request" if isolation == "scope" else "model",
                          max_cached_requests=0 if isolation == "no_cache" else 100)
    finish(method, [1, 2], secret, suffix_cache=isolation != "opt_out_writer")
    reader = method.new_proposer(SamplingParams(suffix_cache=isolation != "opt_out_reader"), None, 0)
    assert draft(reader, [9, 71, 72, 73]) == []
    shared = SuffixMethod(max_tree_depth=16, max_spec_factor=4.0)  # the control: shared, it drafts the secret
    finish(shared, [1, 2], secret)
    assert draft(shared.new_proposer(SamplingParams(), None, 0), [9, 71, 72, 73]) == [74, 75, 76]


def test_proposal_time_on_a_4k_context_is_far_below_a_model_step():
    rng = random.Random(0)
    lines = [[rng.randrange(1000, 30000) for _ in range(rng.randint(5, 15))] for _ in range(60)]
    text: list[int] = []
    while len(text) < 4300:
        text += rng.choice(lines)
    method = SuffixMethod()
    for _ in range(20):
        method.cache.add(text[rng.randrange(3000):][:500])
    proposer = method.new_proposer(SamplingParams(), None, 0)
    proposer.propose(text[:4000], 8)  # builds the request's trie once
    times = []
    for end in range(4002, 4300, 2):
        start = time.perf_counter()
        proposer.propose(text[:end], 8)
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.003  # a model step is ~15 ms; the median step here is ~0.1 ms


# ---- config -----------------------------------------------------------------------------------------------------


def test_model_yaml_and_vllm_json_read_the_suffix_keys(tmp_path):
    (tmp_path / "model.yaml").write_text(
        "model: x\nspeculative_config:\n  decoding_type: Suffix\n  max_draft_len: 8\n"
        "  suffix_decoding_max_tree_depth: 32\n  suffix_decoding_max_cached_requests: 0\n"
        "  suffix_decoding_max_spec_factor: 2\n  suffix_decoding_min_token_prob: 0.3\n  suffix_cache_scope: request\n")
    options = load_model_yaml(tmp_path / "model.yaml").speculative.options
    assert (options.suffix_decoding_max_tree_depth, options.suffix_decoding_max_cached_requests,
            options.suffix_decoding_max_spec_factor, options.suffix_decoding_min_token_prob,
            options.suffix_cache_scope) == (32, 0, 2.0, 0.3, "request")
    (tmp_path / "model.json").write_text('{"model": "x", "speculative_config": {"method": "suffix", '
                                         '"suffix_decoding_max_tree_depth": 16}}')
    spec = load_model_json(tmp_path / "model.json").speculative
    assert spec.method == "suffix" and spec.max_draft_len == 16  # vLLM: the draft length defaults to the depth


@pytest.mark.parametrize("key, value", [
    ("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_tree_depth", 2.5),
    ("suffix_decoding_max_cached_requests", -1), ("suffix_decoding_max_spec_factor", 0),
    ("suffix_decoding_max_spec_factor", "big"), ("suffix_decoding_min_token_prob", 1.5),
    ("suffix_decoding_min_token_prob", -0.1), ("suffix_cache_max_bytes", 0), ("suffix_cache_scope", "global"),
])
def test_bad_suffix_values_name_their_key(key, value):
    with pytest.raises(ConfigError, match=key):
        BY_NAME["suffix"].parse(SpeculativeConfig("suffix", settings={key: value}))


def test_unknown_or_foreign_suffix_keys_are_config_errors(tmp_path):
    (tmp_path / "model.yaml").write_text("model: x\nspeculative_config:\n  decoding_type: Suffix\n"
                                         "  suffix_decoding_max_depth: 3\n")
    with pytest.raises(ConfigError, match="suffix_decoding_max_depth"):
        load_model_yaml(tmp_path / "model.yaml")
    (tmp_path / "model.yaml").write_text("model: x\nspeculative_config:\n  decoding_type: NGram\n"
                                         "  suffix_decoding_max_tree_depth: 8\n")
    with pytest.raises(ConfigError, match="suffix_decoding_max_tree_depth is for suffix"):
        load_model_yaml(tmp_path / "model.yaml")


@pytest.mark.parametrize("bad", [{"num_speculative_tokens": -1}, {"num_speculative_tokens": 1.5},
                                 {"num_speculative_tokens": True}, {"suffix_cache": "yes"}])
def test_bad_per_request_fields_are_request_errors(loaded, bad):
    engine = Engine(loaded("llama"), SuffixMethod(), 4)
    with pytest.raises(RequestError, match=next(iter(bad))):
        engine.generate("Once upon a time", SamplingParams(max_tokens=4, **bad))


# ---- the engine: losslessness, the cache across requests, per-request controls ---------------------------------


REPEATED = ["def add(a, b):", "Once upon a time", "def add(a, b):", "for i in range(10):", "Once upon a time"]


def test_greedy_output_equals_plain_decoding_and_learns_across_requests(loaded):
    target = loaded("llama")
    plain, suffix = Engine(target), Engine(target, SuffixMethod(), 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = []
    for prompt in REPEATED:
        result = suffix.generate(prompt, params)
        assert result.token_ids == plain.generate(prompt, params).token_ids, prompt
        results.append(result.metrics)
    assert suffix.method.stats()["cached_requests"] == len(REPEATED)
    # a prompt seen before is drafted from its earlier response: most of it accepted, far fewer target forwards
    assert results[2].total_accepted_draft_tokens > results[0].total_accepted_draft_tokens
    assert results[2].target_forwards < results[0].target_forwards // 2


def test_batched_greedy_requests_equal_each_alone(loaded):
    target = loaded("qwen3")
    engine = Engine(target, SuffixMethod(), 4)
    requests = [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=8 + 3 * i)) for i in range(12)]
    alone = [Engine(target).generate(prompt, params) for prompt, params in requests]
    batched = run_batched(BatchEngine(engine, max_batch_size=4), requests)
    for i, want in enumerate(alone):
        assert batched[i].token_ids == want.token_ids, i


class Recording(SuffixMethod):
    """The suffix method, keeping every draft tree it proposes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.trees = []

    def new_proposer(self, params, generator, capacity):
        proposer = super().new_proposer(params, generator, capacity)
        propose = proposer.propose

        def recorded(tokens, max_len):
            proposal = propose(tokens, max_len)
            self.trees.append(proposal.tree)
            return proposal

        proposer.propose = recorded
        return proposer


def sample_with_suffix(target, samples: int = 2500, engine: Engine | None = None):
    """The first three tokens of `samples` seeded requests through one suffix engine (each request drafted from
    the responses that ended before it, trees with siblings; 16 requests at a time, as a server runs them), their
    exact target probabilities and how many drafted trees branched."""
    method = Recording(max_spec_factor=4.0, min_token_prob=0.0, max_tree_depth=8)
    engine = engine or Engine(target, method, 3)
    prompt_ids = engine.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
    counts = Counter()
    for output, count in seeded_outputs(engine, prompt_ids, params, samples).items():
        counts[output[:3]] += count
    branched = sum(not tree.is_chain for tree in method.trees)
    return counts, exact_joint(target, prompt_ids, params, 3), branched


def test_sampling_keeps_the_target_distribution(loaded):
    counts, expected, branched = sample_with_suffix(loaded("llama"))
    assert branched > 500  # the cache's siblings were verified, not just chains
    assert follows(counts, expected)


def test_sampling_with_a_broken_verifier_fails(loaded, monkeypatch):
    break_the_verifier(monkeypatch)
    counts, expected, _ = sample_with_suffix(loaded("llama"))
    assert not follows(counts, expected)


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_a_request_cap_bounds_every_step(loaded, cap):
    target = loaded("llama")
    method = Recording()
    engine = Engine(target, method, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.generate("def add(a, b):", params)
    method.trees.clear()
    capped = engine.generate("def add(a, b):", SamplingParams(max_tokens=24, ignore_eos=True,
                                                              num_speculative_tokens=cap))
    uncapped = engine.generate("def add(a, b):", params)
    assert capped.token_ids == uncapped.token_ids
    per_step = len(capped.metrics.drafts_per_position)
    assert per_step <= cap
    if cap == 0:
        assert capped.metrics.total_draft_tokens == 0 and capped.metrics.target_forwards == 24
    else:
        assert capped.metrics.total_draft_tokens > 0
    assert max(len(uncapped.metrics.drafts_per_position), 0) == 4


def test_batch_draft_length_honours_the_caps(loaded):
    engine = Engine(loaded("llama"), SuffixMethod(), 4)
    batch = BatchEngine(engine, max_batch_size=4)
    capped = [batch.engine.new_sequence("Once upon a time", SamplingParams(num_speculative_tokens=cap))
              for cap in (1, 2)]
    assert batch.policy.draft_length.choose(capped) <= 2
    uncapped = batch.engine.new_sequence("Once upon a time", SamplingParams())
    assert batch.policy.draft_length.choose(capped[:1]) <= 1
    assert all(seq.draft_room(4) == 0 for seq in capped + [uncapped])  # not prefilled: no draft yet
    assert capped[0].draft_cap == 1 and uncapped.draft_cap == float("inf")


def test_bench_runs_the_prompts_through_one_method_and_reports_its_cache(loaded):
    from specserve.bench.offline import run_engine_method

    engine = Engine(loaded("llama"), SuffixMethod(), 4)
    run = run_engine_method(engine, ["def add(a, b):", "def add(a, b):"], 16, "suffix")
    assert run.method_state["cached_requests"] == 2  # the warm-up's response was forgotten, both timed ones kept
    summary = run.summary(None)
    assert summary["cache_bytes"] > 0 and summary["cached_tokens"] == run.output_tokens


def test_a_shadow_tree_is_scored_by_the_path_the_target_took():
    from specserve.speculative.policy.draft_length import ShadowDraft
    from specserve.speculative.tree import DraftTree

    class Seq:
        context: list[int] = []

    tree = DraftTree([0, 7, 8, 30, 9], [-1, 0, 1, 1, 2])  # 7 -> (8 -> 9, 30)
    shadow, seq = ShadowDraft(2, tree), Seq()
    for emitted, verdict in (([], None), ([7], None), ([7, 30], (4, 2)), ([7, 8], None), ([7, 8, 9], (4, 3)),
                             ([7, 8, 5], (4, 2)), ([5], (4, 0))):
        seq.context = [1, 2] + emitted
        assert shadow.verdict(seq) == verdict, emitted


# ---- suffix decoding as the lookup branch of EAGLE trees (eagle3+suffix) -----------------------------------------


@pytest.mark.parametrize("method,knobs", [("eagle", {"eagle_choices": [[0], [1], [0, 0], [0, 0, 0]]}),
                                          ("eagle3", {"top_k": 4, "max_total_draft_tokens": 16})])
def test_eagle_with_a_suffix_branch_equals_plain_and_learns_across_requests(method, knobs, loaded, tmp_path):
    from tests.speculative.test_eagle import engine_for, save_random

    target = loaded("llama")
    head = save_random(target, method, tmp_path / "head")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    forwards = {}
    for branch in (False, True):
        engine = engine_for(target, method, head, 4, suffix_branch=branch, **knobs)
        assert engine.method_name == method + ("+suffix" if branch else "")
        forwards[branch] = []
        for prompt in REPEATED:
            got = engine.generate(prompt, params)
            assert got.token_ids == Engine(target).generate(prompt, params).token_ids, (method, branch, prompt)
            forwards[branch].append(got.metrics.target_forwards)
    assert engine.method.stats()["cached_requests"] == len(REPEATED)
    # a random head's drafts fail; the second time a prompt comes, the cached response is drafted and accepted
    assert forwards[True][2] < forwards[False][2] and forwards[True][4] < forwards[False][4]


def test_eagle_suffix_branch_config(tmp_path):
    from specserve.speculative.registry import label, parse_method

    path = tmp_path / "model.yaml"
    path.write_text("model: m\nspeculative_config:\n  decoding_type: Eagle3\n  speculative_model: h\n"
                    "  suffix_branch: true\n  suffix_decoding_max_spec_factor: 2.0\n")
    options = load_model_yaml(path).speculative.options
    assert options.label == "eagle3+suffix" and options.suffix == {"suffix_decoding_max_spec_factor": 2.0}
    assert label("Eagle3+suffix_decoding") == "eagle3+suffix"
    assert parse_method("eagle3+suffix")[1] == {"prompt_lookup_branch": False, "suffix_branch": True}
    path.write_text("model: m\nspeculative_config:\n  decoding_type: Eagle3\n  speculative_model: h\n"
                    "  suffix_branch: true\n  prompt_lookup_branch: true\n")
    with pytest.raises(ConfigError, match="one lookup branch"):
        load_model_yaml(path)
    path.write_text("model: m\nspeculative_config:\n  decoding_type: NGram\n  suffix_branch: true\n")
    with pytest.raises(ConfigError, match="suffix_branch is for EAGLE"):
        load_model_yaml(path)


def test_eagle_suffix_branch_sampling_keeps_the_target_distribution(loaded, tmp_path):
    """A random EAGLE-3 head with the suffix branch: the cached responses' chains are accepted or rejected, the
    head's top-k siblings mostly rejected; the output follows the target's distribution."""
    from tests.speculative.test_eagle import engine_for, save_random

    target = loaded("llama")
    engine = engine_for(target, "eagle3", save_random(target, "eagle3", tmp_path / "head"), 3, top_k=2,
                        max_total_draft_tokens=4, suffix_branch=True, suffix_decoding_max_spec_factor=4.0)
    counts, expected, _ = sample_with_suffix(target, engine=engine)
    assert engine.method.stats()["cached_requests"] == 2500
    assert follows(counts, expected)
