"""EAGLE-1 / EAGLE-2 / EAGLE-3: the published checkpoint layouts (names, shapes, mismatch errors), greedy output
equal to plain decoding for every family and tree shape, stops inside accepted paths (with a head trained here on
the shared TinyStories model, so that paths do get accepted), batching, and sampling that keeps the target's
distribution while a broken sibling-resampling step does not."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specserve.config import (ConfigError, DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine,
                              load_model_yaml)
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.models.loader import load_model
from specserve.models.quant import QuantLinear
from specserve.speculative.eagle import EagleHead, load_eagle, new_eagle_head, save_eagle
from specserve.speculative.eagle_draft import EagleMethod, EagleOptions, EagleProposer
from specserve.speculative.eagle_kernels import KernelHead
from specserve.speculative.lookup_branch import LookupBranch
from specserve.speculative.policy.acceptance import Acceptance, AcceptanceByEvidence
from specserve.speculative.policy.tree_budget import Nodes
from specserve.speculative.policy.tree_budget import TreeBudget
from specserve.speculative.registry import label, parse_method
from specserve.speculative.sampling import SamplingParams
from specserve.train.heads import TrainSettings, train
from tests.conftest import STORY_HELD_OUT, STORY_PROMPTS
from tests.engine.test_batching import run_batched
from tests.speculative.test_sampling_lossless import break_the_verifier, exact_joint, follows, seeded_outputs

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox jumps over the lazy dog. The lazy"]
SMALL_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
HELD_OUT = STORY_HELD_OUT


def save_random(target, kind: str, directory, seed: int = 0, safetensors: bool = False):
    vocab = torch.arange(0, target.model.spec.vocab_size, 2) if kind == "eagle3" else None
    return save_eagle(new_eagle_head(target.model.spec, kind, vocab, seed=seed, std=0.2), directory, safetensors)


def engine_for(target, method: str, head_dir, max_draft_len: int = 4, adaptive: bool = False, **settings):
    """`settings`: speculative_config keys (top_k, max_total_draft_tokens, eagle_choices, prompt_lookup_branch)."""
    spec = SpeculativeConfig(method, max_draft_len, str(head_dir), adaptive, settings)
    return build_engine(DeploymentConfig(ModelConfig(str(target.path)), speculative=spec), target)


# ---- layouts -------------------------------------------------------------------------------------------------

EAGLE3_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
                "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
EAGLE1_NAMES = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
                *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def test_eagle3_layout_names_shapes_and_config(loaded, tmp_path):
    target = loaded("llama")
    spec = target.model.spec
    path = save_random(target, "eagle3", tmp_path / "e3")
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    assert set(state) == EAGLE3_NAMES
    h, draft_vocab = spec.hidden_size, spec.vocab_size // 2
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert state["lm_head.weight"].shape == (draft_vocab, h)
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool
    assert int(state["t2d"].sum()) == draft_vocab
    assert torch.equal(torch.arange(draft_vocab) + state["d2t"], torch.arange(0, spec.vocab_size, 2))
    config = json.loads((path / "config.json").read_text())
    assert config["draft_vocab_size"] == draft_vocab and config["architectures"] == ["LlamaForCausalLMEagle3"]
    head = load_eagle(path, "eagle3", spec)
    assert all(torch.equal(head.state_dict()[k], v) for k, v in state.items())


def test_eagle1_layout_and_safetensors(loaded, tmp_path):
    target = loaded("qwen2")
    head = new_eagle_head(target.model.spec, "eagle")
    head.config.fc_bias = True
    head = EagleHead(head.config)  # the original EAGLE trains fc with a bias
    save_eagle(head, tmp_path / "bin")
    assert set(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)) == EAGLE1_NAMES
    save_eagle(head, tmp_path / "st", safetensors=True)
    loaded_head = load_eagle(tmp_path / "st", "eagle", target.model.spec)
    assert loaded_head.fc.bias is not None and not hasattr(loaded_head.layers[0], "input_layernorm")


@pytest.mark.parametrize("case,needle", [
    ("hidden", "hidden size"), ("vocab", "vocabulary"), ("kind", "EAGLE-1/2 head"), ("missing", "missing"),
    ("layers", "target layer"), ("nodir", "does not exist"),
])
def test_mismatches_are_clear_errors(loaded, tmp_path, case, needle):
    target = loaded("llama")
    spec = target.model.spec
    method, path = "eagle3", tmp_path / "head"
    if case == "hidden":
        other = type(spec)(**{**spec.__dict__, "hidden_size": 32, "num_heads": 2, "head_dim": 16})
        save_eagle(new_eagle_head(other, "eagle3"), path)
    elif case == "vocab":
        save_eagle(new_eagle_head(type(spec)(**{**spec.__dict__, "vocab_size": 500}), "eagle3"), path)
    elif case == "kind":
        save_random(target, "eagle", path)
    elif case == "missing":
        save_random(target, "eagle3", path)
        state = torch.load(path / "pytorch_model.bin", weights_only=True)
        del state["midlayer.hidden_norm.weight"]
        torch.save(state, path / "pytorch_model.bin")
    elif case == "layers":
        head = new_eagle_head(spec, "eagle3", aux_layer_ids=[1, 2, 9])
        save_eagle(head, path)
    elif case == "nodir":
        path = tmp_path / "absent"
    with pytest.raises(ConfigError, match=needle):
        engine_for(target, method, path)


# ---- greedy == plain -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("method,knobs", [
    ("eagle", {"eagle_choices": SMALL_CHOICES}),
    ("eagle2", {"top_k": 3, "max_total_draft_tokens": 10}),
    ("eagle3", {"top_k": 4, "max_total_draft_tokens": 16}),
])
def test_greedy_equals_plain(family, method, knobs, loaded, tmp_path):
    target = loaded(family)
    head = save_random(target, "eagle3" if method == "eagle3" else "eagle", tmp_path / "head")
    params = SamplingParams(max_tokens=24)
    for depth in (1, 3):
        engine = engine_for(target, method, head, depth, **knobs)
        drafted = 0
        for prompt in PROMPTS:
            want = Engine(target).generate(prompt, params)
            got = engine.generate(prompt, params)
            assert got.token_ids == want.token_ids and got.text == want.text, (family, method, depth, prompt)
            drafted += got.metrics.total_draft_tokens
        assert drafted > 0


def test_hardware_aware_budget_is_lossless(loaded, tmp_path):
    target = loaded("gemma3")
    engine = engine_for(target, "eagle3", save_random(target, "eagle3", tmp_path / "h"), 5, adaptive=True)
    assert engine.method.verify_seconds is not None
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=30)
        assert engine.generate(prompt, params).token_ids == Engine(target).generate(prompt, params).token_ids


@pytest.mark.parametrize("method", ["eagle3", "eagle3+ngram", "eagle"])
def test_a_head_that_does_not_pay_stops_drafting_and_stays_exact(loaded, tmp_path, method, monkeypatch):
    """A random head with measured costs (the default): the draft gate finds its drafts never pay and runs the
    head only on rare probes (speculative/policy/draft_gate.py); the output is plain decoding's throughout."""
    target = loaded("gemma3")
    kind = "eagle" if method == "eagle" else "eagle3"
    name, _, branch = method.partition("+")
    settings = {"prompt_lookup_branch": True} if branch else {}
    engine = engine_for(target, name, save_random(target, kind, tmp_path / "h"), 5, adaptive=True, **settings)
    assert_drafts_on_rare_probes(engine, target, monkeypatch, EagleProposer, "_grow")


def assert_drafts_on_rare_probes(engine, target, monkeypatch, proposer, drafting: str) -> None:
    """Each output equals plain decoding's, and once the first requests have taught the pool the model drafts
    (`proposer.drafting` runs) on at most a fifth of the target's forwards."""
    calls = []
    run = getattr(proposer, drafting)
    monkeypatch.setattr(proposer, drafting, lambda self, *a: calls.append(1) or run(self, *a))
    steps = []
    for prompt in PROMPTS * 2:
        params = SamplingParams(max_tokens=48)
        calls.clear()
        got = engine.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids
        steps.append((len(calls), got.metrics.target_forwards))
    ran, total = map(sum, zip(*steps[3:]))
    assert ran <= 0.2 * total, steps


# ---- prompt lookup as a branch of the tree --------------------------------------------------------------------

REPEATING = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("method,knobs", [
    ("eagle", {"eagle_choices": SMALL_CHOICES}),
    ("eagle3", {"top_k": 4, "max_total_draft_tokens": 16}),
])
def test_lookup_branch_greedy_equals_plain(family, method, knobs, loaded, tmp_path):
    target = loaded(family)
    head = save_random(target, "eagle3" if method == "eagle3" else "eagle", tmp_path / "head")
    params = SamplingParams(max_tokens=24)
    forwards = {}
    for lookup in (False, True):
        engine = engine_for(target, method, head, 4, prompt_lookup_branch=lookup, **knobs)
        assert engine.method_name == method + ("+ngram" if lookup else "")
        forwards[lookup] = 0
        for prompt in PROMPTS + [REPEATING]:
            want = Engine(target).generate(prompt, params)
            got = engine.generate(prompt, params)
            assert got.token_ids == want.token_ids and got.text == want.text, (family, method, lookup, prompt)
            forwards[lookup] += got.metrics.target_forwards
    assert forwards[True] < forwards[False]  # a random head's drafts fail; the lookup chains get accepted


def test_lookup_branch_with_budget_is_lossless(loaded, tmp_path, monkeypatch):
    """With measured costs, steps where the lookup chain alone promises more than the head's last tree skip the
    head (its pairs are caught up later, several steps at once); both kinds of step must stay exact."""
    target = loaded("gemma3")
    head = save_random(target, "eagle3", tmp_path / "h")
    engine = engine_for(target, "eagle3", head, 5, adaptive=True, prompt_lookup_branch=True)
    choices = []
    decide = TreeBudget.lookup_alone_pays
    monkeypatch.setattr(TreeBudget, "lookup_alone_pays",
                        lambda self, reach: choices.append(decide(self, reach)) or choices[-1])
    for prompt in PROMPTS + [REPEATING]:
        params = SamplingParams(max_tokens=30)
        assert engine.generate(prompt, params).token_ids == Engine(target).generate(prompt, params).token_ids
    assert True in choices and False in choices


def test_a_seeded_request_s_lookup_branch_learns_from_its_own_tokens_only(loaded, tmp_path):
    target = loaded("gemma3")
    head = save_random(target, "eagle3", tmp_path / "h")
    method = engine_for(target, "eagle3", head, 5, adaptive=True, prompt_lookup_branch=True).method
    assert method.branches.for_request(SamplingParams(), 64).acceptance.pool is method.branches.pool
    assert method.branches.for_request(SamplingParams(seed=3), 64).acceptance.pool is None


def test_lookup_chain_merges_into_the_tree():
    nodes = Nodes(5, torch.zeros(1))
    a = nodes.add(0, 7, -0.1, 0)
    b = nodes.add(a, 8, -3.0, 0)
    nodes.add(0, 9, -1.0, 1)
    nodes.merge_chain([7, 8, 4, 6], reach=[0.5 ** d for d in range(1, 5)], offset=0.0)
    assert nodes.looked_up == 2  # 7 and 8 were drafted by the head already
    assert nodes.scores[a] == -0.1 and nodes.scores[b] == pytest.approx(2 * math.log(0.5))  # the better score
    tree = nodes.tree(list(range(1, len(nodes.tokens))))
    assert tree.tokens.tolist() == [5, 7, 9, 8, 4, 6]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    # the head drafting the lookup's next token below b takes that node over instead of adding a twin
    four = nodes.tokens.index(4)
    assert nodes.add(b, 4, -0.5, 0) == four and nodes.looked_up == 1
    assert nodes.scores[four] == pytest.approx(max(3 * math.log(0.5), nodes.scores[b] - 0.5))
    assert nodes.add(b, 3, -0.5, 1) == len(nodes.tokens) - 1  # a new token is a new node


def test_lookup_acceptance_is_judged_on_the_committed_tokens_by_position():
    pool = AcceptanceByEvidence.pooled()
    lookup = LookupBranch(1, 3, pool)
    tokens = [1, 2, 3, 4, 1, 2]
    chain, reach = lookup.propose(tokens, 3)
    prior = Acceptance()
    assert chain == [3, 4, 1]  # "1 2" recurs
    assert reach == pytest.approx(prior.path_probabilities(3))  # the prior before any evidence
    # the target then produced 3, 4, 9: the first lookup token right, the second right after it, the third wrong
    chain, reach = lookup.propose(tokens + [3, 4, 9], 3)
    seen = Acceptance()
    seen.update(3, 2)
    assert lookup.acceptance[2].first.value == pytest.approx(seen.first.value)
    assert lookup.acceptance[2].further.value == pytest.approx(seen.further.value)
    assert seen.first.value > prior.first.value and seen.further.value < prior.further.value
    assert pool[2].first.value > prior.first.value  # the method's pool learnt it too
    assert chain == [] and reach == []  # "4 9" / "9" never occurred before
    # a chain that only ever fails at its first token is soon scored below one right from the start
    for _ in range(10):
        lookup.acceptance.update(3, 0, 1)
    assert lookup.acceptance[1].path_probabilities(1)[0] < lookup.acceptance[2].path_probabilities(1)[0]


def test_a_step_looks_its_chain_up_once(monkeypatch):
    """The draft gate asks whether the branch has a chain, then the step proposes it: one lookup for both, and a
    new one when the tokens or the length asked for change."""
    lookup = LookupBranch(1, 3)
    calls = []
    real = lookup.index.lookup
    monkeypatch.setattr(lookup.index, "lookup", lambda tokens, max_len: calls.append(max_len) or real(tokens, max_len))
    tokens = [1, 2, 3, 4, 1, 2]
    assert lookup.has_chain(tokens, 3)
    assert lookup.propose(tokens, 3)[0] == [3, 4, 1]
    assert calls == [3]
    assert lookup.propose(tokens, 2)[0] == [3, 4] and calls == [3, 2]
    assert not lookup.has_chain(tokens + [9], 2) and calls == [3, 2, 2]


def test_lookup_chain_scores_value_long_chains_right_after_their_first_token():
    """Lookup chains right at their first token are right for long: scored by position, a chain's deep nodes
    keep their chance where one per-token rate would have cut them."""
    acceptance = Acceptance()
    for _ in range(20):
        acceptance.update(6, 0)
        acceptance.update(6, 6)
    reach = acceptance.path_probabilities(6)
    assert reach[0] == pytest.approx(acceptance.first.value)
    assert reach[5] / reach[4] == pytest.approx(acceptance.further.value) and reach[5] > 0.5 ** 6


def test_lookup_branch_config_and_names(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("model: m\nspeculative_config:\n  decoding_type: Eagle3\n  speculative_model: h\n"
                    "  prompt_lookup_branch: true\n  prompt_lookup_max: 4\n")
    config = load_model_yaml(path)
    options = config.speculative.options
    assert (options.name, options.lookup_branch, options.prompt_lookup_max) == ("eagle3", True, 4)
    assert config.speculative.label == "eagle3+ngram"
    path.write_text("model: m\nspeculative_config:\n  decoding_type: NGram\n  prompt_lookup_branch: true\n")
    with pytest.raises(ConfigError, match="prompt_lookup_branch is for EAGLE"):
        load_model_yaml(path)
    assert label("Eagle3+prompt_lookup") == "eagle3+ngram"
    assert parse_method("eagle2")[1] == {"prompt_lookup_branch": False, "suffix_branch": False}
    for bad in ("ngram+ngram", "eagle3+medusa"):
        with pytest.raises(ConfigError, match=r"'\+ngram' follows eagle"):
            parse_method(bad)


# ---- a trained head: accepted paths, stops inside them, batching, sampling ---------------------------------------

@pytest.fixture(scope="module")
def stories(tmp_path_factory, story_data):
    """stories260K and EAGLE-3 / EAGLE-1 heads trained on its own stories (a few seconds each)."""
    target, data, records, _ = story_data
    root = tmp_path_factory.mktemp("stories")
    heads = {}
    for kind in ("eagle3", "eagle"):
        settings = TrainSettings(kind=kind, steps=150, batch_size=8, seq_len=80, draft_vocab_size=256, lr=3e-3,
                                 save_every=1000)
        train(settings, target, records, root / kind, data.aux_layer_ids, progress=False)
        heads[kind] = root / kind
    return target, heads


@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle3"])
def test_trained_head_accepts_paths_and_stays_exact(stories, method):
    target, heads = stories
    engine = engine_for(target, method, heads["eagle3" if method == "eagle3" else "eagle"], 5)
    params = SamplingParams(max_tokens=60)
    forwards = tokens = 0
    for prompt in HELD_OUT:
        got = engine.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids
        forwards += got.metrics.target_forwards
        tokens += got.metrics.output_tokens
    assert tokens / forwards > 1.8  # tau: paths several nodes deep are accepted


def test_static_tree_budget_cuts_the_tree_and_stays_exact(stories):
    """With measured costs a static tree is cut to its most probable closed subtree: exact, fewer nodes."""
    target, heads = stories
    full = engine_for(target, "eagle", heads["eagle"], 5)
    cut = engine_for(target, "eagle", heads["eagle"], 5)
    cut.method.verify_seconds = lambda n: 1.0 + 0.1 * n  # every verified node costs a tenth of a plain step
    params = SamplingParams(max_tokens=60)
    stats = {}
    for name, engine in (("full", full), ("cut", cut)):
        drafted = forwards = tokens = 0
        for prompt in HELD_OUT:
            got = engine.generate(prompt, params)
            assert got.token_ids == Engine(target).generate(prompt, params).token_ids, name
            drafted, forwards = drafted + got.metrics.total_draft_tokens, forwards + got.metrics.target_forwards
            tokens += got.metrics.output_tokens
        stats[name] = (drafted / forwards, tokens / forwards)
    assert 0 < stats["cut"][0] < stats["full"][0] / 3  # far fewer nodes a step (mc_sim_7b_63 drafts up to 63)
    assert stats["cut"][1] > 1.5  # still accepting paths


def test_stop_tokens_and_strings_inside_accepted_paths(stories):
    target, heads = stories
    engine = engine_for(target, "eagle3", heads["eagle3"], 5)
    plain = Engine(target).generate(HELD_OUT[0], SamplingParams(max_tokens=60))
    for cut in (9, 17, 26, 41):  # a stop at several offsets: some fall inside an accepted path
        stop_id = plain.token_ids[cut]
        params = SamplingParams(max_tokens=60, stop_token_ids=[stop_id])
        want = Engine(target).generate(HELD_OUT[0], params)
        got = engine.generate(HELD_OUT[0], params)
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == "stop"
        stop_text = plain.text[len(plain.text) // 3 + cut: len(plain.text) // 3 + cut + 4]
        params = SamplingParams(max_tokens=60, stop=[stop_text])
        want, got = Engine(target).generate(HELD_OUT[0], params), engine.generate(HELD_OUT[0], params)
        assert got.text == want.text and not got.text.endswith(stop_text) and got.finish_reason == "stop"


def test_batched_equals_alone(stories):
    target, heads = stories
    engine = engine_for(target, "eagle3", heads["eagle3"], 4)
    requests = [(HELD_OUT[i % 3], SamplingParams(max_tokens=10 + 7 * i)) for i in range(6)]
    alone = [Engine(target).generate(p, params) for p, params in requests]
    batched = run_batched(BatchEngine(engine, max_batch_size=3), requests)
    assert [batched[i].token_ids for i in range(6)] == [r.token_ids for r in alone]


def test_head_cache_follows_the_committed_tokens(stories):
    """After many steps, the head's cache holds exactly what running it over the committed pairs gives."""
    target, heads = stories
    engine = engine_for(target, "eagle3", heads["eagle3"], 5)
    seq = engine.new_sequence(HELD_OUT[1], SamplingParams(max_tokens=40), 200)
    from specserve.models.kv_cache import KVCache
    cache = KVCache.for_model(target.model, 1, 200)
    while not seq.finished:
        engine.draft([seq], 5)
        engine.forward(cache, [seq])
    proposer = seq.proposer
    committed = seq.tokens
    features = target.model(torch.tensor([committed]), torch.arange(len(committed))[None],
                            KVCache.for_model(target.model, 1, len(committed)), torch.arange(len(committed))[None],
                            output_layers=engine.hidden_layers).hidden_states
    features = torch.cat([features[i][0] for i in engine.hidden_layers], -1)
    head = engine.method.head
    fresh = head.new_cache(len(committed) + 1)
    n = proposer.stable
    positions = torch.arange(n)
    head(features[:n], engine.method.embed(torch.tensor(committed[1: n + 1])), positions, fresh, positions,
         torch.ones(n, n, dtype=torch.bool).tril())
    assert n >= len(committed) - 8
    torch.testing.assert_close(proposer.cache.keys[0][:, :, :n], fresh.keys[0][:, :, :n], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(proposer.cache.values[0][:, :, :n], fresh.values[0][:, :, :n], atol=1e-5, rtol=1e-4)


def eagle_statistics(stories, samples: int = 2000, lookup: bool = False, method: str = "eagle3"):
    target, heads = stories
    head = heads["eagle3" if method == "eagle3" else "eagle"]
    engine = engine_for(target, method, head, 2, top_k=2, max_total_draft_tokens=4, prompt_lookup_branch=lookup)
    # a training prompt: the head's drafts land in the support; repeated, so that the lookup branch has chains
    prompt_ids = engine.encode(f"{STORY_PROMPTS[0]}, there was a girl. {STORY_PROMPTS[0]}" if lookup
                               else STORY_PROMPTS[0])
    # a high temperature flattens the target, so drafts are often rejected and siblings resampled
    params = SamplingParams(temperature=3.0, top_k=2, max_tokens=3, ignore_eos=True)
    return seeded_outputs(engine, prompt_ids, params, samples), exact_joint(target, prompt_ids, params, 3)


@pytest.mark.parametrize("method,lookup", [("eagle3", False), ("eagle3", True), ("eagle2", False)],
                         ids=["tree", "tree+lookup", "eagle1-draft-vocabulary"])
def test_sampling_keeps_target_distribution(stories, method, lookup):
    """eagle2 runs the EAGLE-1 head, whose drafts are scored over its draft vocabulary (draft_vocab.json)."""
    counts, expected = eagle_statistics(stories, lookup=lookup, method=method)
    assert follows(counts, expected)


def test_broken_sibling_resampling_is_caught(stories, monkeypatch):
    break_the_verifier(monkeypatch)
    counts, expected = eagle_statistics(stories)
    assert not follows(counts, expected)


# ---- configuration ---------------------------------------------------------------------------------------------

def test_model_yaml_eagle_spellings(tmp_path):
    def parse(body: str) -> SpeculativeConfig:
        path = tmp_path / "model.yaml"
        path.write_text("model: m\nspeculative_config:\n" + body)
        return load_model_yaml(path).speculative

    static = parse("  decoding_type: Eagle\n  max_draft_len: 5\n  speculative_model: h\n"
                   "  eagle_choices: [[0], [0, 0]]\n")
    assert (static.method, static.max_draft_len, static.options.choices) == ("eagle", 5, [[0], [0, 0]])
    repo = parse("  decoding_type: Eagle\n  speculative_model: h\n  top_k: 10\n  depth: 5\n  total_token: 60\n")
    assert (repo.method, repo.options.top_k, repo.max_draft_len, repo.options.total_tokens) == ("eagle2", 10, 6, 59)
    trt = parse("  decoding_type: Eagle3\n  speculative_model: h\n  num_eagle_layers: 4\n"
                "  max_non_leaves_per_layer: 6\n  max_total_draft_tokens: 30\n  eagle3_layers_to_capture: [1, 3, 5]\n")
    assert (trt.method, trt.max_draft_len, trt.options.top_k, trt.options.total_tokens, trt.options.layers) == \
        ("eagle3", 4, 6, 30, [1, 3, 5])
    assert parse("  decoding_type: Eagle\n  use_dynamic_tree: true\n").method == "eagle2"
    with pytest.raises(ConfigError, match="eagle3_layers_to_capture"):
        parse("  decoding_type: Eagle3\n  eagle3_layers_to_capture: [1]\n")
    with pytest.raises(ConfigError, match="top_k"):
        parse("  decoding_type: Eagle3\n  top_k: 0\n")


def test_eagle_method_rejects_bad_budget(loaded):
    target = loaded("llama")
    with pytest.raises(ValueError, match="top_k"):
        EagleMethod(new_eagle_head(target.model.spec, "eagle"), target.model, "eagle2", 3, top_k=0)


def test_eagle3_from_model_yaml_through_the_cli(loaded, checkpoint, tmp_path):
    from typer.testing import CliRunner

    from specserve.cli import app
    target = loaded("qwen3")
    save_random(target, "eagle3", tmp_path / "head")  # the model.yaml names it ./head
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(f"model: {checkpoint('qwen3')}\ndtype: float32\nspeculative_config:\n"
                         f"  decoding_type: Eagle3\n  max_draft_len: 3\n  speculative_model: ./head\n"
                         f"  adaptive_draft_len: false\n  top_k: 4\n  total_token: 13\n")
    out = CliRunner().invoke(app, ["generate", PROMPTS[0], "--model", str(yaml_file), "--max-tokens", "20", "--json"])
    result = json.loads(out.stdout)
    plain = Engine(target).generate(PROMPTS[0], SamplingParams(max_tokens=20))
    assert result["method"] == "eagle3" and result["text"] == plain.text and result["lossless"]
    assert result["metrics"]["total_draft_tokens"] > 0


def test_target_cache_after_many_tree_steps_equals_plain_prefill(stories):
    """The accepted paths are compacted in place: after a whole generation the target's cache holds exactly the
    keys and values a plain forward over the same committed tokens computes."""
    from specserve.models.kv_cache import KVCache

    target, heads = stories
    engine = engine_for(target, "eagle3", heads["eagle3"], 5)
    seq = engine.new_sequence(HELD_OUT[2], SamplingParams(max_tokens=50), 200)
    cache = KVCache.for_model(target.model, 1, 200)
    accepted = 0
    while not seq.finished:
        engine.draft([seq], 5)
        engine.forward(cache, [seq])
        accepted = seq.metrics.total_accepted_draft_tokens
    assert accepted > 5
    committed = seq.tokens
    assert int(cache.lengths[0]) == len(committed)
    fresh = KVCache.for_model(target.model, 1, len(committed))
    positions = torch.arange(len(committed))[None]
    target.model(torch.tensor([committed]), positions, fresh, positions)
    for layer in range(target.model.spec.num_layers):
        for ours, plain in ((cache.keys[layer], fresh.keys[layer]), (cache.values[layer], fresh.values[layer])):
            torch.testing.assert_close(ours[0, :, : len(committed)], plain[0, :, : len(committed)],
                                       atol=1e-5, rtol=1e-4)


# ---- drafting on the CPU kernels -------------------------------------------------------------------------------

def bf16_head(spec, kind: str, layers: int = 1) -> EagleHead:
    head = new_eagle_head(spec, kind, torch.arange(0, spec.vocab_size, 2) if kind == "eagle3" else None, seed=1,
                          std=0.2)
    if kind == "eagle":  # EAGLE-1's several layers (the first without an input norm) and fc bias
        head.config.num_layers, head.config.fc_bias = layers, True
        fresh = EagleHead(head.config)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, param in fresh.named_parameters():
                if not name.endswith("norm.weight"):
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        head = fresh
    return head.to(torch.bfloat16).eval()


@pytest.mark.parametrize("quantization,tolerance", [("none", 0.02), ("int8", 0.05)])
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_kernel_head_computes_what_the_pytorch_head_does(loaded, kind, quantization, tolerance):
    """The kernels' head forward over committed pairs and then a tree level: the PyTorch head's outputs, draft
    lm_head inputs and cache entries, to bf16 rounding with bf16 weights and to their rounding with int8."""
    spec = loaded("llama").model.spec
    head = bf16_head(spec, kind, layers=2)
    kernels = KernelHead(head, quantization)
    width = 3 * spec.hidden_size if kind == "eagle3" else spec.hidden_size
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(6, width, generator=generator).bfloat16()
    embeds = torch.randn(9, spec.hidden_size, generator=generator).bfloat16()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and its two children
    level_mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree], dim=1)
    results = []
    with torch.no_grad():  # inference, as drafting runs
        for run in (lambda *a: (lambda out: (out, head.lm_inputs(out)))(head(*a)), kernels.forward):
            cache = head.new_cache(12)
            positions = torch.arange(6)
            causal = torch.ones(6, 6, dtype=torch.bool).tril()
            out, _ = run(features, embeds[:6], positions, cache, positions, causal)
            level, lm_inputs = run(out[-3:].contiguous(), embeds[6:], torch.tensor([6, 7, 7]), cache,
                                   torch.arange(6, 9), level_mask)
            results.append((level.float(), lm_inputs.float(), cache.keys[-1][:, :, :9].float()))
    for want, got in zip(*results):
        assert (got - want).norm() <= tolerance * want.norm()
    logits = kernels.draft_logits(results[1][1].bfloat16(), lambda x: x.float() @ torch.randn(x.shape[-1], 5))
    assert logits.dtype == torch.float32 and logits.shape[0] == 3


def assert_drafts_and_equals_plain(engine, target) -> None:
    """Greedy on PROMPTS: every output equals plain decoding's, and the method drafted at all."""
    params = SamplingParams(max_tokens=24)
    drafted = 0
    for prompt in PROMPTS:
        got = engine.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids, (engine.method.name, prompt)
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0


@pytest.mark.parametrize("method,knobs", [("eagle", {"eagle_choices": SMALL_CHOICES}),
                                          ("eagle3", {"top_k": 4, "max_total_draft_tokens": 16}),
                                          ("eagle3", {"quantization": "none"}),
                                          ("eagle3", {"quantization": "int4"})])
def test_greedy_equals_plain_drafting_on_the_kernels(checkpoint, tmp_path, method, knobs):
    target = load_model(checkpoint("llama"), dtype=torch.bfloat16)
    head = save_random(target, "eagle3" if method == "eagle3" else "eagle", tmp_path / "head")
    engine = engine_for(target, method, head, 3, **knobs)
    assert engine.method.kernels is not None
    assert_drafts_and_equals_plain(engine, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eagle1_draft_vocabulary_scores_those_rows_of_the_target_lm_head(checkpoint, tmp_path, dtype):
    """An EAGLE-1 head with a draft_vocab.json scores its drafts over those tokens only, with the target's own
    logits for them (int8 rows on the kernels), and stays exact."""
    from specserve.speculative.weights import write_draft_vocab

    target = load_model(checkpoint("llama"), dtype=dtype)
    head = save_random(target, "eagle", tmp_path / "head")
    vocab = torch.arange(1, target.model.spec.vocab_size, 3)
    write_draft_vocab(head, vocab)
    engine = engine_for(target, "eagle", head, 3, eagle_choices=SMALL_CHOICES, quantization="int8")
    method = engine.method
    assert torch.equal(method.vocab_map, vocab)
    assert isinstance(method.vocab_rows.linear, QuantLinear) == (dtype == torch.bfloat16)  # int8 on the kernels
    x = torch.randn(4, target.model.spec.hidden_size, dtype=dtype)
    rows = method.vocab_rows(x)
    expected = target.model.logits(x)[:, vocab].float()
    assert rows.shape == (4, vocab.numel())
    assert torch.allclose(rows, expected, atol=0.05 * expected.abs().max().item())
    assert method.to_target_ids(torch.tensor([0, 2])).tolist() == vocab[[0, 2]].tolist()
    assert_drafts_and_equals_plain(engine, target)


def test_a_bad_eagle1_draft_vocabulary_is_refused_at_load(loaded, tmp_path):
    target = loaded("llama")
    head = save_random(target, "eagle", tmp_path / "head")
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": [0, target.model.spec.vocab_size]}))
    with pytest.raises(ConfigError, match="outside the target's vocabulary"):
        engine_for(target, "eagle", head)


def test_head_quantization_setting():
    assert EagleOptions.read({"quantization": "int8"})["quantization"] == "int8"
    assert EagleOptions.read({"quantization": None})["quantization"] == "none"
    with pytest.raises(ConfigError, match="quantization 'fp8'"):
        EagleOptions.read({"quantization": "fp8"})


@pytest.mark.parametrize("per_token,drafts_on", [(0.004, False), (0.0, True)])
def test_another_level_pays_for_its_verification(per_token, drafts_on):
    """A level is worth drafting only where its expected gain pays for its drafting and for verifying its nodes: a
    steep verify cost (a CPU) stops a level that flat costs (a GPU) take, at the same gain and drafting time."""
    budget = TreeBudget(lambda n: 0.010 + per_token * (n - 1), top_k=8, total_tokens=16, static=False)
    budget.time_level(0.001)
    nodes = Nodes(0, None)
    child = nodes.add(0, 5, math.log(0.6), 0)
    assert budget.best(nodes)[0] == [child]
    assert budget.worth_another_level(nodes, [child]) is drafts_on


def test_budget_ranking_is_reused_only_for_the_same_tree():
    """select reuses the last level check's ranking, but not after the tree changed: a lookup chain that raises
    an existing node's score (no new node) or a new node must be ranked anew."""
    budget = TreeBudget(lambda n: 0.010 + 0.001 * (n - 1), top_k=8, total_tokens=2, static=False)
    budget.time_level(0.001)
    nodes = Nodes(0, None)
    first = nodes.add(0, 5, math.log(0.5), 0)
    second = nodes.add(0, 6, math.log(0.3), 1)
    assert budget.best(nodes)[0] == [first, second]
    nodes.merge_chain([6], reach=[0.9], offset=0.0)  # the lookup chain shares node `second`, now scoring log 0.9
    assert budget.best(nodes)[0] == [second, first]
    third = nodes.add(second, 7, math.log(0.99), 0)
    assert budget.best(nodes)[0] == [second, third]


def test_sampling_keeps_target_distribution_drafting_on_the_kernels(checkpoint, tmp_path):
    target = load_model(checkpoint("llama"), dtype=torch.bfloat16)
    head = save_random(target, "eagle3", tmp_path / "head")
    engine = engine_for(target, "eagle3", head, 2, top_k=2, max_total_draft_tokens=4)
    assert engine.method.kernels is not None
    prompt_ids = engine.encode(PROMPTS[1])
    params = SamplingParams(temperature=3.0, top_k=2, max_tokens=3, ignore_eos=True)
    counts = seeded_outputs(engine, prompt_ids, params, 2000)
    assert follows(counts, exact_joint(target, prompt_ids, params, 3))
