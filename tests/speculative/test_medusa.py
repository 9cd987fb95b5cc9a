"""Medusa tree speculation through the engine: greedy output equals plain decoding for every family, batched or
alone, and sampling keeps the target's distribution (the broken-verifier control for tree sampling is in
tests/test_tree.py, where its bias is large enough to show at this sample size)."""

from __future__ import annotations

import pytest
import torch

from specserve.checks import ConfigError
from specserve.engine.batch import BatchEngine
from specserve.engine.engine import Engine
from specserve.models.loader import load_model
from specserve.models.quant import QuantLinear
from specserve.speculative.medusa import MedusaHeads, ResBlock
from specserve.speculative.medusa_draft import MedusaMethod, MedusaOptions
from specserve.speculative.medusa_kernels import KernelMedusa
from specserve.speculative.choices import DEFAULT_CHOICES
from specserve.speculative.sampling import SamplingParams
from tests.engine.test_batching import run_batched
from tests.speculative.test_sampling_lossless import follows, sample_three_tokens

PROMPTS = ["def fibonacci(n):", "Once upon a time", "The quick brown fox jumps over the lazy dog. The lazy"]
SMALL_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [2], [0, 0, 0, 0]]


def random_heads(model, seed: int = 0, num_heads: int = 4) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(model.spec.hidden_size, model.spec.vocab_size, num_heads)
    with torch.no_grad():  # an lm_head copy per head, so candidates overlap the target's choices sometimes
        for head in heads.heads:
            head[-1].weight.copy_(model.lm_head_weight.float() + 0.3 * torch.randn_like(head[-1].weight))
    return heads


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("max_draft_len", [1, 2, 4])
def test_medusa_greedy_equals_plain(family, max_draft_len, loaded):
    target = loaded(family)
    method = MedusaMethod(random_heads(target.model), SMALL_CHOICES)
    params = SamplingParams(max_tokens=30)
    drafted = 0
    for prompt in PROMPTS:
        want = Engine(target).generate(prompt, params)
        got = Engine(target, method, max_draft_len).generate(prompt, params)
        assert got.token_ids == want.token_ids and got.text == want.text, (family, prompt)
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0


def test_medusa_with_the_default_tree_and_batching(loaded):
    target = loaded("llama")
    engine = Engine(target, MedusaMethod(random_heads(target.model)), 4)  # mc_sim_7b_63: 64 nodes
    requests = [(PROMPTS[i % 3], SamplingParams(max_tokens=6 + 4 * i)) for i in range(6)]
    alone = [Engine(target).generate(p, params) for p, params in requests]
    batched = run_batched(BatchEngine(engine, max_batch_size=3), requests)
    assert [batched[i].token_ids for i in range(6)] == [r.token_ids for r in alone]


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("quantization,tolerance", [("int8", 0.05), ("int4", 0.2)])
def test_kernel_heads_compute_what_the_pytorch_heads_do(loaded, compact, quantization, tolerance):
    """Quantized heads on the kernels: each bf16 head's logits, to their rounding (head 1 through two ResBlocks)."""
    heads = random_heads(loaded("llama").model, num_heads=3)
    heads.heads[1].insert(0, ResBlock(heads.hidden_size))  # head 1: two ResBlocks
    heads = heads.to(torch.bfloat16).eval()
    if compact:  # as load_medusa does: the draft vocabulary's rows of the bf16 lm_heads
        heads.restrict_vocab(torch.arange(0, heads.vocab_size, 2))
    kernels = KernelMedusa(heads, quantization)
    assert all(isinstance(linear, QuantLinear) for linear in kernels.lm_heads + kernels.blocks[1])
    hidden = torch.randn(heads.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        want = heads(hidden[None])[:, 0]
        got = torch.stack([kernels.head_logits(hidden, i) for i in range(3)])
    assert got.dtype == torch.float32 and got.shape == want.shape == (3, heads.lm_weights[0].shape[0])
    for i in range(3):
        assert (got[i] - want[i]).norm() <= tolerance * want[i].norm(), i


def test_greedy_equals_plain_drafting_on_the_kernels(checkpoint):
    target = load_model(checkpoint("llama"), dtype=torch.bfloat16)
    method = MedusaMethod(random_heads(target.model).to(torch.bfloat16), SMALL_CHOICES)
    assert method.runner is not None
    params = SamplingParams(max_tokens=24)
    drafted = 0
    for prompt in PROMPTS:
        got = Engine(target, method, 3).generate(prompt, params)
        assert got.token_ids == Engine(target).generate(prompt, params).token_ids, prompt
        drafted += got.metrics.total_draft_tokens
    assert drafted > 0


def medusa_statistics(loaded):
    target = loaded("llama")
    return sample_three_tokens(Engine(target, MedusaMethod(random_heads(target.model, 1, 2),
                                                           [[0], [1], [0, 0], [1, 0]]), 2))


def test_medusa_sampling_keeps_target_distribution(loaded):
    counts, expected = medusa_statistics(loaded)
    assert follows(counts, expected)



def test_medusa_from_model_yaml_and_cli(loaded, checkpoint, tmp_path):
    import json

    from typer.testing import CliRunner

    from specserve.cli import app
    from specserve.speculative.medusa import save_medusa
    target = loaded("qwen2")
    heads = save_medusa(random_heads(target.model, num_heads=3), tmp_path / "heads")
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(f"model: {checkpoint('qwen2')}\ndtype: float32\nspeculative_config:\n  decoding_type: Medusa\n"
                         f"  max_draft_len: 3\n  speculative_model: {heads}\n  medusa_choices: {SMALL_CHOICES}\n")
    runner = CliRunner()
    spec = json.loads(runner.invoke(app, ["generate", PROMPTS[0], "--model", str(yaml_file), "--max-tokens", "20",
                                          "--json"]).stdout)
    plain = Engine(target).generate(PROMPTS[0], SamplingParams(max_tokens=20))
    assert spec["method"] == "medusa" and spec["text"] == plain.text
    assert spec["metrics"]["total_draft_tokens"] > 0
    other = tmp_path / "wrong"
    save_medusa(MedusaHeads(32, 384, 2), other)  # trained for another hidden size
    result = runner.invoke(app, ["generate", "hi", "--model", checkpoint("qwen2"), "--method", "medusa",
                                 "--draft-model", str(other), "--dtype", "float32"])
    assert result.exit_code == 2 and "hidden" in result.output


def test_typical_acceptance_is_opt_in_and_reported_lossy(loaded, checkpoint, tmp_path):
    from specserve.config import build_engine, load_model_yaml
    from specserve.speculative.medusa import save_medusa
    from specserve.speculative.tree import DraftTree
    from specserve.speculative.verify import TypicalAcceptance, verify

    # unit: a child is accepted when its token's probability clears min(threshold, alpha * exp(-entropy))
    tree = DraftTree(torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 0]))
    logits = torch.log(torch.tensor([[0.05, 0.02, 0.93, 0.0], [0.25] * 4, [0.25] * 4]) + 1e-9)
    verdict = verify(tree, logits, SamplingParams(temperature=1.0), torch.Generator(), typical=TypicalAcceptance(0.09, 0.3))
    assert verdict.nodes == [2]  # limit min(0.09, 0.3 * e^-H) = 0.09: token 1 (0.02) fails, token 2 (0.93) passes
    strict = verify(tree, logits, SamplingParams(temperature=1.0), torch.Generator(), typical=TypicalAcceptance(0.95, 5.0))
    assert strict.nodes == [] and strict.accepted == 0
    target = loaded("qwen2")
    heads = save_medusa(random_heads(target.model, num_heads=2), tmp_path / "heads")
    yaml_file = tmp_path / "model.yaml"
    yaml_file.write_text(f"model: {checkpoint('qwen2')}\ndtype: float32\nspeculative_config:\n  decoding_type: Medusa\n"
                         f"  max_draft_len: 2\n  speculative_model: {heads}\n  typical_acceptance: true\n")
    engine = build_engine(load_model_yaml(yaml_file), target)
    assert not engine.lossless and Engine(target).lossless
    params = SamplingParams(max_tokens=20)
    assert engine.generate(PROMPTS[0], params).token_ids == Engine(target).generate(PROMPTS[0], params).token_ids
    sampled = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.8, seed=3))
    assert len(sampled.token_ids) > 0


def verify_cost(n: float) -> float:
    return 1.0 + 0.15 * n  # a CPU-like curve: each verified token costs 15% of a plain step


def confident_heads(sharpness: float) -> MedusaHeads:
    """3 heads without ResBlocks whose logits favour token 5 (head 0), 6, 7 by `sharpness` over the other 37."""
    heads = MedusaHeads(16, 40, num_heads=3, num_layers=0)
    with torch.no_grad():
        for i, head in enumerate(heads.heads):
            head[-1].weight.zero_()
            head[-1].weight[5 + i, 0] = sharpness
    return heads.eval()


def deepest(tree) -> int:
    return int(tree.depth.max()) if len(tree.draft) else 0


def run_steps(method: MedusaMethod, accepted, steps: int = 30) -> list[int]:
    """Tree sizes over `steps` steps, the target accepting `accepted(tree)` nodes of each."""
    proposer = method.new_proposer(SamplingParams(), None, 64)
    hidden = torch.zeros(1, 16)
    hidden[0, 0] = 1.0
    proposer.observe_hidden(hidden)
    sizes = []
    for _ in range(steps):
        tree = proposer.propose([1, 2, 3], 5).tree
        sizes.append(len(tree.draft))
        proposer.observe_hidden(hidden.repeat(1 + accepted(tree), 1))
    return sizes


def test_the_heads_confidence_and_the_acceptance_a_request_gets_size_its_trees():
    confident = MedusaMethod(confident_heads(12.0), verify_seconds=verify_cost)
    always = run_steps(confident, deepest)
    assert all(size >= 3 for size in always)  # the sure path to depth 3, every step
    never = run_steps(confident, lambda tree: 0)
    assert never[0] >= 3 and never[-1] == 0  # calibrated down by what the target accepts
    flat = run_steps(MedusaMethod(confident_heads(0.0), verify_seconds=verify_cost), lambda tree: 0, steps=1)
    assert flat == [0]  # 1/40 a node does not pay for its verification
    whole = run_steps(MedusaMethod(confident_heads(0.0)), lambda tree: 0, steps=1)  # no costs: the whole tree
    assert whole == [sum(len(c) <= 3 for c in DEFAULT_CHOICES)]


def test_a_budgeted_tree_is_closed_under_parents():
    method = MedusaMethod(confident_heads(3.0), verify_seconds=lambda n: 1.0 + 0.02 * n)
    proposer = method.new_proposer(SamplingParams(), None, 64)
    proposer.observe_hidden(torch.ones(1, 16))
    tree = proposer.propose([1], 5).tree
    parents = tree.parents.tolist()
    assert 1 < len(tree.draft) < 60 and all(parents[i] < i for i in range(1, len(parents)))


def test_choices_without_their_parents_are_refused():
    with pytest.raises(ValueError, match="every prefix"):
        MedusaMethod(confident_heads(1.0), [[0], [1, 0]])


@pytest.mark.parametrize("sharpness,heads_run", [(0.0, {0}), (12.0, {0, 1, 2})])
def test_a_deeper_head_runs_only_where_its_level_pays(sharpness, heads_run):
    heads, calls = confident_heads(sharpness), []
    pytorch_head = heads.head_logits
    heads.head_logits = lambda hidden, index: calls.append(index) or pytorch_head(hidden, index)
    run_steps(MedusaMethod(heads, verify_seconds=verify_cost), deepest, steps=3)
    assert set(calls) == heads_run


def test_head_quantization_setting(loaded):
    assert MedusaOptions.read({"quantization": "int8"})["quantization"] == "int8"
    assert MedusaOptions.read({"quantization": None})["quantization"] == "none"
    assert MedusaOptions.read({}).get("quantization", MedusaOptions.quantization) == "int4"
    with pytest.raises(ConfigError, match="quantization 'fp8' for Medusa heads"):
        MedusaOptions.read({"quantization": "fp8"})
    heads = random_heads(loaded("llama").model, num_heads=2).to(torch.bfloat16).eval()
    for quantization in ("int8", "int4"):
        runner = MedusaMethod(heads, SMALL_CHOICES, head_quantization=quantization).runner
        assert {linear.packed.kind for linear in runner.lm_heads} == {quantization}
