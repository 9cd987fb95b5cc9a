"""DFlash block drafting: z-lab's drafter layout (names, config, refusals), greedy output equal to plain decoding
for every family and on the kernels, a drafter trained here on the shared TinyStories model whose blocks do get
accepted, a context cache that follows the committed tokens, and sampling that keeps the target's distribution
while a broken verifier does not."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.config import ConfigError, DeploymentConfig, ModelConfig, SpeculativeConfig, build_engine
from specserve.config import load_model_yaml
from specserve.config_vllm import load_model_json
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.models.loader import load_model
from specserve.models.step_costs import StepCosts
from specserve.speculative.dflash import DFlashConfig, load_dflash, new_dflash, save_dflash
from specserve.speculative.policy.tree_budget import TreeBudget
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.weights import write_draft_vocab
from specserve.train.heads import TrainSettings, train
from tests.conftest import STORY_HELD_OUT, STORY_PROMPTS
from tests.engine.test_batching import CPU_LIKE_COSTS, run_batched
from tests.speculative.test_eagle import PROMPTS, assert_drafts_on_rare_probes
from tests.speculative.test_sampling_lossless import break_the_verifier, exact_joint, follows, seeded_outputs

LAYER_NAMES = {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
               "self_attn.k_norm.weight", *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def save_random(target, directory, layers: int = 1, block: int = 5, std: float = 0.3, seed: int = 0):
    spec = target.model.spec
    return save_dflash(new_dflash(spec, layers, block, 0, 1.0, seed=seed, std=std), directory)


def engine_for(target, head_dir, max_draft_len: int = 4, adaptive: bool = False, **settings):
    spec = SpeculativeConfig("dflash", max_draft_len, str(head_dir), adaptive, settings)
    return build_engine(DeploymentConfig(ModelConfig(str(target.path)), speculative=spec), target)


def assert_drafts_and_equals_plain(engine, target, prompts=PROMPTS, max_tokens: int = 24) -> float:
    """Greedy: every output equals plain decoding's and the method drafted at all; returns tau."""
    params = SamplingParams(max_tokens=max_tokens)
    drafted = forwards = tokens = 0
    for prompt in prompts:
        got = engine.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids, prompt
        drafted += got.metrics.total_draft_tokens
        forwards += got.metrics.target_forwards
        tokens += got.metrics.output_tokens
    assert drafted > 0
    return tokens / forwards


# ---- layout -----------------------------------------------------------------------------------------------------

def test_layout_is_z_labs(loaded, tmp_path):
    target = loaded("qwen3")
    path = save_random(target, tmp_path / "d", layers=2)
    names = set(json.loads((path / "model.safetensors").read_bytes()[8:].split(b"}}")[0] + b"}}"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight",
                *(f"layers.{i}.{name}" for i in range(2) for name in LAYER_NAMES)}
    assert names - {"__metadata__"} == expected
    config = json.loads((path / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 5 and config["num_hidden_layers"] == 2
    spec = target.model.spec
    assert load_dflash(path, spec).fc.weight.shape == (spec.hidden_size, 3 * spec.hidden_size)


def test_a_checkpoint_written_as_z_lab_writes_it_loads(loaded, tmp_path):
    """Their config: a Qwen3 config with dflash_config (target_layer_ids, block_size, mask_token_id), tensors
    under a `model.` prefix allowed."""
    target = loaded("llama")
    spec = target.model.spec
    drafter = new_dflash(spec, 1, 16, 3, 1.0, target_layer_ids=[0, 1])
    from safetensors.torch import save_file

    tmp_path.mkdir(exist_ok=True)
    save_file({f"model.{k}": v.contiguous() for k, v in drafter.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "attention_bias": False, "block_size": 16,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 3}}))
    loaded_drafter = load_dflash(tmp_path, spec)
    assert (loaded_drafter.config.block_size, loaded_drafter.config.mask_token_id) == (16, 3)
    assert torch.equal(loaded_drafter.fc.weight, drafter.fc.weight)


@pytest.mark.parametrize("case,needle", [("hidden", "hidden size"), ("layers", "target layers"),
                                         ("dflash2", "DFlash-2"), ("mask", "mask_token_id"),
                                         ("missing", "missing"), ("nodir", "config.json")])
def test_mismatches_are_clear_errors(loaded, tmp_path, case, needle):
    target = loaded("llama")
    spec = target.model.spec
    path = tmp_path / "d"
    if case == "hidden":
        other = type(spec)(**{**spec.__dict__, "hidden_size": 32, "num_heads": 2, "head_dim": 16})
        save_dflash(new_dflash(other, 1, 4, 0, 1.0), path)
    elif case == "layers":
        save_dflash(new_dflash(spec, 1, 4, 0, 1.0, target_layer_ids=[0, 7]), path)
    elif case in ("dflash2", "mask"):
        save_random(target, path)
        config = json.loads((path / "config.json").read_text())
        config["dflash_config"].update({"selector_rank": 64} if case == "dflash2" else {"mask_token_id": 10 ** 6})
        (path / "config.json").write_text(json.dumps(config))
    elif case == "missing":
        save_random(target, path)
        from safetensors.torch import load_file, save_file

        state = load_file(path / "model.safetensors")
        del state["layers.0.self_attn.q_norm.weight"]
        save_file(state, path / "model.safetensors")
    with pytest.raises(ConfigError, match=needle):
        engine_for(target, path)


def test_config_spellings(tmp_path):
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text("model: m\nspeculative_config:\n  decoding_type: DFlash\n  max_draft_len: 7\n"
                         "  speculative_model: drafter\n")
    spec = load_model_yaml(yaml_file).speculative
    assert (spec.method, spec.model, spec.max_draft_len) == ("dflash", "drafter", 7)
    json_file = tmp_path / "model.json"
    json_file.write_text(json.dumps({"model": "m", "speculative_config": {
        "method": "dflash", "model": "drafter", "num_speculative_tokens": 15}}))
    spec = load_model_json(json_file).speculative
    assert (spec.method, spec.model, spec.max_draft_len) == ("dflash", "drafter", 15)
    assert DFlashConfig.from_json(DFlashConfig(8, 2, 1, 4, 16, 1, [0], 4, 0).to_json()).block_size == 4


# ---- greedy: exact ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_greedy_equals_plain(family, loaded, tmp_path):
    target = loaded(family)
    assert_drafts_and_equals_plain(engine_for(target, save_random(target, tmp_path / "d")), target)


def test_a_drafter_that_does_not_pay_stops_drafting_and_stays_exact(loaded, tmp_path, monkeypatch):
    """A random drafter with measured costs: the draft gate finds its blocks never pay and runs it only on rare
    probes; the output is plain decoding's throughout."""
    from specserve.speculative.dflash_draft import DFlashProposer

    target = loaded("gemma3")
    engine = engine_for(target, save_random(target, tmp_path / "d"), 4, adaptive=True)
    assert_drafts_on_rare_probes(engine, target, monkeypatch, DFlashProposer, "_block")


@pytest.mark.parametrize("vocabulary,quantization", [(False, "int4"), (True, "int4"), (True, "int8"),
                                                    (False, "none")])
def test_greedy_equals_plain_on_the_kernels(checkpoint, tmp_path, vocabulary, quantization):
    """bf16 on the CPU kernels, the drafter's linears packed as asked; with a draft_vocab.json, drafts are scored
    over those rows of the target's lm_head only (and every drafted token is one of them)."""
    from specserve.models.quant import QuantLinear

    target = load_model(checkpoint("llama"), dtype=torch.bfloat16)
    path = save_random(target, tmp_path / "d")
    ids = torch.arange(0, target.model.spec.vocab_size, 3)
    if vocabulary:
        write_draft_vocab(path, ids)
    engine = engine_for(target, path, quantization=quantization)
    assert (engine.method.vocab_rows is not None) == vocabulary
    packed = isinstance(engine.method.drafter.layers[0].mlp.down_proj, QuantLinear)
    assert packed == (quantization != "none")
    assert_drafts_and_equals_plain(engine, target)
    if vocabulary:
        proposer = engine.method.new_proposer(SamplingParams(), torch.Generator(), 64)
        tokens = engine.encode(PROMPTS[0])
        proposer.observe_hidden(torch.randn(len(tokens) - 1, 3 * target.model.spec.hidden_size))
        assert set(proposer.propose(tokens, 4).tokens) <= set(ids.tolist())


def test_the_kernel_block_computes_the_drafter_block(checkpoint):
    """The block on the kernels (one LayerStack call over the context cache) gives the PyTorch block's outputs,
    within bf16 rounding, and leaves the cached context as it was."""
    from specserve.speculative.dflash import ContextCache
    from specserve.speculative.dflash_kernels import KernelBlock, usable

    target = load_model(checkpoint("qwen3"), dtype=torch.bfloat16)
    spec = target.model.spec
    drafter = new_dflash(spec, 2, 5, 0, 1.0, std=0.3).to(torch.bfloat16).eval()
    if not usable(drafter):
        pytest.skip("no CPU kernels here")
    cache = ContextCache(drafter, 32)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 9, 3 * spec.hidden_size, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        cache.append(drafter.context(features, torch.arange(9)[None]))
        context = [(k.clone(), v.clone()) for k, v in cache.view()]
        embeds = torch.randn(5, spec.hidden_size, generator=generator).to(torch.bfloat16)
        positions = torch.arange(9, 14)
        expected = drafter.block(embeds[None], positions[None], context)[0]
        got = KernelBlock(drafter)(embeds, *drafter.rotary(positions), cache)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.05)
    assert all(torch.equal(k, kept) for (k, _), (kept, _) in zip(cache.view(), context))


# ---- a trained drafter ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stories(tmp_path_factory, story_data):
    """stories260K and a DFlash drafter trained on its own stories (a few seconds)."""
    target, data, records, _ = story_data
    path = tmp_path_factory.mktemp("dflash")
    settings = TrainSettings(kind="dflash", steps=300, batch_size=8, seq_len=80, draft_vocab_size=256, lr=1e-2,
                             warmup=20, save_every=1000, draft_layers=1, block_size=5, anchors=16)
    train(settings, target, records, path, data.aux_layer_ids, progress=False)
    return target, path


def test_trained_drafter_accepts_blocks_and_stays_exact(stories):
    target, path = stories
    tau = assert_drafts_and_equals_plain(engine_for(target, path, 4), target, STORY_HELD_OUT, 60)
    assert tau > 1.3  # blocks several tokens long are accepted


def test_measured_costs_verify_the_prefix_that_pays_and_stay_exact(stories):
    """With a cost table in which each verified token costs more (as a CPU's does past a few rows) each step verifies
    the block's best prefix by the drafter's calibrated confidence: fewer tokens than a whole block on average, the
    same output. (The tiny target's measured forwards cost the same up to a tile's 9 rows, where a whole block pays.)"""
    target, path = stories
    engine = engine_for(target, path, 4, adaptive=True)
    assert engine.method.verify_seconds is not None
    engine.method.verify_seconds = StepCosts(None, 1, list(CPU_LIKE_COSTS))
    params = SamplingParams(max_tokens=60)
    drafted = steps = 0
    for prompt in STORY_HELD_OUT:
        got = engine.generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids
        drafted += got.metrics.total_draft_tokens
        steps += got.metrics.drafts_per_position[0] if got.metrics.drafts_per_position else 0
    assert 0 < drafted < 4 * steps


def test_batched_equals_alone(stories):
    target, path = stories
    engine = engine_for(target, path, 4)
    requests = [(STORY_HELD_OUT[i % 3], SamplingParams(max_tokens=10 + 7 * i)) for i in range(6)]
    alone = [Engine(target).generate(p, params) for p, params in requests]
    batched = run_batched(BatchEngine(engine, max_batch_size=3), requests)
    assert [batched[i].token_ids for i in range(6)] == [r.token_ids for r in alone]


@pytest.mark.parametrize("branch,label", [("prompt_lookup_branch", "dflash+ngram"),
                                          ("suffix_branch", "dflash+suffix")])
def test_a_lookup_branch_joins_the_block_and_stays_exact(stories, monkeypatch, branch, label):
    """With a lookup branch the block's chain and the branch's are one tree, cut by the measured costs; on prompts
    that repeat themselves the branch has chains to add, and the output is plain decoding's. Whether a step
    skips the drafter for the chain alone depends on timings: here it never does, so every chain is merged."""
    from specserve.speculative.dflash_draft import DFlashProposer

    target, path = stories
    engine = engine_for(target, path, 4, adaptive=True, **{branch: True})
    assert engine.method.name == label
    monkeypatch.setattr(TreeBudget, "lookup_alone_pays", lambda self, reach: False)
    merged = []
    with_branch = DFlashProposer._with_branch
    monkeypatch.setattr(DFlashProposer, "_with_branch", lambda self, *a: merged.append(1) or with_branch(self, *a))
    assert_drafts_and_equals_plain(engine, target, [f"{p} {p}" for p in STORY_HELD_OUT], 40)
    assert merged


def test_context_cache_follows_the_committed_tokens(stories):
    """After a generation the drafter's cache holds what injecting the committed tokens' features at once gives."""
    target, path = stories
    engine = engine_for(target, path, 4)
    seen = []
    original = engine.method.new_proposer

    def keep(*args):
        seen.append(original(*args))
        return seen[-1]

    engine.method.new_proposer = keep
    result = engine.generate(STORY_HELD_OUT[0], SamplingParams(max_tokens=40, ignore_eos=True))
    proposer = seen[0]
    proposer._inject(proposer.cache.length + sum(f.shape[0] for f in proposer.features))
    n = proposer.cache.length
    committed = engine.encode(STORY_HELD_OUT[0]) + result.token_ids
    assert n >= len(committed) - 6
    ids = torch.tensor([committed[:n]])
    positions = torch.arange(n)[None]
    from specserve.models.kv_cache import KVCache

    out = target.model(ids, positions, KVCache.for_model(target.model, 1, n), positions,
                       output_layers=engine.method.hidden_layers)
    features = torch.cat([out.hidden_states[i] for i in engine.method.hidden_layers], -1)
    keys, _ = engine.method.drafter.context(features, positions)[0]
    torch.testing.assert_close(proposer.cache.view()[0][0], keys, atol=1e-4, rtol=1e-4)


def dflash_statistics(stories, samples: int = 2000, prompt: str = STORY_PROMPTS[0], **settings):
    target, path = stories
    engine = engine_for(target, path, 2, **settings)
    prompt_ids = engine.encode(prompt)  # a training prompt: the drafts land in the support
    # a high temperature flattens the target, so drafts are often rejected and residuals resampled
    params = SamplingParams(temperature=3.0, top_k=2, max_tokens=3, ignore_eos=True)
    return seeded_outputs(engine, prompt_ids, params, samples), exact_joint(target, prompt_ids, params, 3)


def test_sampling_keeps_target_distribution(stories):
    """Sampled blocks: each position drawn from its q."""
    counts, expected = dflash_statistics(stories)
    assert follows(counts, expected)


def test_sampling_with_a_lookup_branch_keeps_target_distribution(stories, monkeypatch):
    """With a branch: trees of both chains' deterministic candidates (the prompt repeats, so the branch has chains)."""
    from specserve.speculative.dflash_draft import DFlashProposer

    merged = []
    with_branch = DFlashProposer._with_branch
    monkeypatch.setattr(DFlashProposer, "_with_branch", lambda self, *a: merged.append(1) or with_branch(self, *a))
    prompt = f"{STORY_PROMPTS[0]}, {STORY_PROMPTS[0]}"
    counts, expected = dflash_statistics(stories, prompt=prompt, prompt_lookup_branch=True)
    assert follows(counts, expected)
    assert len(merged) > 1000


def test_broken_verifier_is_caught(stories, monkeypatch):
    break_the_verifier(monkeypatch)
    counts, expected = dflash_statistics(stories)
    assert not follows(counts, expected)
