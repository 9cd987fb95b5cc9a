"""Draft trees: construction from Medusa choices, greedy and sampling verification (statistical losslessness),
tree attention through the real model (each node sees exactly its root path), KV compaction of the accepted path,
and the Medusa head checkpoint layout."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import specserve.speculative.verify as verify_module
from specserve.models.kv_cache import KVCache
from specserve.speculative.choices import mc_sim_7b_63
from specserve.speculative.medusa import MedusaHeads, load_medusa, save_medusa
from specserve.speculative.medusa_draft import MedusaMethod
from specserve.speculative.sampling import SamplingParams, probabilities, sample
from specserve.speculative.tree import Chain, DraftTree, tree_from_choices
from specserve.speculative.verify import verify
from tests.speculative.test_sampling_lossless import total_variation, tv_bound

# Deliberately unsorted; sorted by (depth, ranks): [0] [1] [0,0] [0,1] [1,0] [0,0,0] -> nodes 1..6.
SMALL_CHOICES = [[1], [0, 0], [0], [0, 1], [0, 0, 0], [1, 0]]
SMALL_CANDIDATES = [[10, 11], [20, 21], [30]]


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root to `node`, both included."""
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def small_tree(root: int = 5) -> DraftTree:
    return tree_from_choices(SMALL_CHOICES, SMALL_CANDIDATES, root_token=root)


def test_tree_from_choices_by_hand():
    tree = small_tree()
    assert tree.tokens.tolist() == [5, 10, 11, 20, 21, 20, 30]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103]
    assert [path_to(tree, leaf) for leaf in (4, 5, 6)] == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert [n for n in range(len(tree)) if not tree.children(n)] == [4, 5, 6]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, expected)
    assert tree.children(0) == [1, 2] and tree.children(1) == [3, 4] and tree.children(6) == []


def test_default_medusa_tree_shape():
    candidates = [list(range(100 * d, 100 * d + 10)) for d in range(4)]
    tree = tree_from_choices(mc_sim_7b_63, candidates, root_token=7)
    assert len(tree) == 64 and int(tree.depth.max()) == 4
    # each node attends to depth + 1 nodes; its token is candidates[depth - 1][last rank] (Medusa's
    # tree_indices) and its root path follows the sorted order (Medusa's retrieve_indices)
    assert torch.equal(tree.mask.sum(-1), tree.depth + 1)
    ordered = sorted(mc_sim_7b_63, key=lambda c: (len(c), c))
    for i, choice in enumerate(ordered, start=1):
        assert int(tree.tokens[i]) == candidates[len(choice) - 1][choice[-1]]
        assert path_to(tree, i)[1:] == [ordered.index(choice[:k]) + 1 for k in range(1, len(choice) + 1)]


def test_tree_from_choices_errors():
    with pytest.raises(ValueError, match="lacks its parent"):
        tree_from_choices([[0, 0]], [[1], [2]])
    with pytest.raises(ValueError, match="rank 2"):
        tree_from_choices([[2]], [[1, 2]])
    with pytest.raises(ValueError, match="depth 2"):
        tree_from_choices([[0], [0, 0]], [[1]])
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))


def greedy(tree: DraftTree, logits: torch.Tensor):
    return verify(tree, logits, SamplingParams(), torch.Generator())


def greedy_logits(tree: DraftTree, argmax: dict[int, int], vocab: int = 50) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(tree), vocab, generator=gen)
    for node, token in argmax.items():
        logits[node, token] = 10.0
    return logits


def test_greedy_accepts_deep_path_with_bonus():
    tree = small_tree()
    logits = greedy_logits(tree, {0: 10, 1: 20, 3: 30, 6: 42})
    nodes, tokens = greedy(tree, logits)
    assert nodes == [1, 3, 6] and tokens == [10, 20, 30, 42]


def test_greedy_takes_second_sibling_and_corrects():
    tree = small_tree()
    logits = greedy_logits(tree, {0: 11, 2: 20, 5: 7})  # [1] -> [1, 0]; then argmax 7 is the bonus
    assert greedy(tree, logits) == ([2, 5], [11, 20, 7])
    logits = greedy_logits(tree, {0: 10, 1: 21, 4: 3})  # second child of node 1, a leaf
    assert greedy(tree, logits) == ([1, 4], [10, 21, 3])


def test_greedy_rejects_at_root():
    tree = small_tree()
    logits = greedy_logits(tree, {0: 12})
    verdict = greedy(tree, logits)
    assert verdict.nodes == [] and verdict.tokens == [12] and verdict.accepted == 0


def test_greedy_prefers_deepest_among_repeated_siblings():
    tree = DraftTree(torch.tensor([0, 4, 4, 6]), torch.tensor([-1, 0, 0, 2]))
    logits = torch.zeros(4, 10)
    logits[0, 4] = logits[1, 9] = logits[2, 6] = logits[3, 1] = 1.0
    assert greedy(tree, logits) == ([2, 3], [4, 6, 1])


# ---- sampling: statistical losslessness ------------------------------------------------------------------

VOCAB = 6
LOSSLESS_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def sampling_statistics(deterministic: bool, params: SamplingParams, samples: int = 12000):
    """Target rows are prefix-independent: p_d at every node of depth d; draft rows q_d likewise."""
    gen = torch.Generator().manual_seed(0)
    p_logits = torch.randn(4, VOCAB, generator=gen) * 1.5
    q_logits = torch.randn(4, VOCAB, generator=gen) * 1.5
    p, q = probabilities(p_logits, params), probabilities(q_logits, params)
    shape = tree_from_choices(LOSSLESS_CHOICES, [list(range(3))] * 3)
    depth = shape.depth
    logits = p_logits[depth]  # [N, V]
    q_nodes = q[depth]  # children of a depth-d node were drawn from q_d
    ranked = [q[d].argsort(descending=True).tolist() for d in range(3)]  # fixed top-k candidates
    fixed = tree_from_choices(LOSSLESS_CHOICES, ranked)
    first, second = Counter(), Counter()
    for _ in range(samples):
        if deterministic:
            tree, q_arg = fixed, None
        else:  # every child an i.i.d. draw from its parent's q
            drawn = sample(q_nodes[shape.parents.clamp(min=0)], gen)
            drawn[0] = 0
            tree, q_arg = DraftTree(drawn, shape.parents), q_nodes
        verdict = verify(tree, logits, params, gen, q_arg)
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            second[verdict.tokens[1]] += 1
    return p, first, second


CASES = [(True, SamplingParams(temperature=1.0)), (False, SamplingParams(temperature=1.0)),
         (True, SamplingParams(temperature=0.8, top_k=4, top_p=0.95))]


@pytest.mark.parametrize("deterministic,params", CASES)
def test_tree_sampling_keeps_target_distribution(deterministic, params):
    p, first, second = sampling_statistics(deterministic, params)
    n_first, n_second = sum(first.values()), sum(second.values())
    assert n_second > 1000
    assert total_variation(first, dict(enumerate(p[0].tolist())), n_first) < tv_bound(VOCAB, n_first)
    assert total_variation(second, dict(enumerate(p[1].tolist())), n_second) < tv_bound(VOCAB, n_second)


@pytest.mark.parametrize("deterministic", [True, False])
def test_broken_tree_sampling_fails_the_same_test(deterministic, monkeypatch):
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q: p)  # no subtraction of q
    monkeypatch.setattr(verify_module, "without_token", lambda p, token: p)  # nor of a deterministic draft's token
    p, first, _ = sampling_statistics(deterministic, SamplingParams(temperature=1.0))
    n = sum(first.values())
    assert total_variation(first, dict(enumerate(p[0].tolist())), n) > tv_bound(VOCAB, n)


def test_a_chain_is_a_one_branch_tree():
    chain = Chain(3, [1, 4, 1])
    tree = DraftTree(torch.tensor([3, 1, 4, 1]), torch.arange(-1, 3))
    for name in ("tokens", "parents", "depth", "mask"):
        assert torch.equal(getattr(chain, name), getattr(tree, name)), name
    assert [chain.children(i) for i in range(4)] == [tree.children(i) for i in range(4)]
    logits = torch.zeros(4, 8)
    logits[0, 1] = logits[1, 4] = logits[2, 2] = 1.0
    assert greedy(chain, logits) == greedy(tree, logits) == ([1, 2], [1, 4, 2])  # the fast path agrees


# ---- the real model: tree attention and compaction ---------------------------------------------------------

def prefill(model, cache: KVCache, ids: list[int]) -> torch.Tensor:
    start = int(cache.lengths[0])
    pos = torch.arange(start, start + len(ids))[None]
    logits = model(torch.tensor([ids]), pos, cache, pos).logits[0]
    cache.lengths[0] = start + len(ids)
    return logits


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_forward_equals_chain_forward_and_compaction(loaded, family):
    model = loaded(family).model
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, vocab, (11,), generator=gen).tolist()  # longer than gemma3's sliding window (8)
    candidates = [torch.randint(3, vocab, (2,), generator=gen).tolist() for _ in range(3)]
    tree = tree_from_choices(SMALL_CHOICES, candidates, root_token=int(torch.randint(3, vocab, (1,), generator=gen)))
    n, base = len(tree), len(prompt)
    cache = KVCache.for_model(model, 1, 64)
    prefill(model, cache, prompt)

    def tree_forward():
        slots = torch.arange(base, base + n)[None]
        return model(tree.tokens[None], tree.positions(base)[None], cache, slots,
                     tree_mask=tree.mask[None]).logits[0]

    tree_logits = tree_forward()
    assert int(cache.lengths[0]) == base  # the forward never commits
    for node in range(n):
        path = path_to(tree, node)
        pos = torch.arange(base, base + len(path))[None]
        chain = model(tree.tokens[path][None], pos, cache, pos).logits[0, -1]
        torch.testing.assert_close(tree_logits[node], chain)

    # logits_rows picks rows of the same forward
    rows = torch.tensor([[0, 3, 6]])
    picked = model(tree.tokens[None], tree.positions(base)[None], cache, torch.arange(base, base + n)[None],
                   tree_mask=tree.mask[None], logits_rows=rows).logits[0]
    torch.testing.assert_close(picked, tree_logits[[0, 3, 6]])

    # accept root -> node 2 -> node 5 (slots base+0, base+2, base+5), compact, then one plain step
    tree_forward()
    accepted = path_to(tree, 5)
    cache.compact(0, base + torch.tensor(accepted), base)
    cache.lengths[0] = base + len(accepted)
    next_token = 42
    step = prefill(model, cache, [next_token])[-1]

    reference = KVCache.for_model(model, 1, 64)
    prefill(model, reference, prompt)
    for token in tree.tokens[accepted].tolist():
        prefill(model, reference, [token])
    expected = prefill(model, reference, [next_token])[-1]
    torch.testing.assert_close(step, expected)


# ---- Medusa heads -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("safetensors,layers", [(True, 1), (False, 2)])
def test_medusa_round_trip(tmp_path, safetensors, layers):
    torch.manual_seed(0)
    heads = MedusaHeads(16, 40, num_heads=3, num_layers=layers, base_model_name_or_path="tiny")
    save_medusa(heads, tmp_path, safetensors=safetensors)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == layers
    assert (tmp_path / ("medusa_lm_head.safetensors" if safetensors else "medusa_lm_head.pt")).exists()
    published = {f"{i}.{j}.linear.{w}" for i in range(3) for j in range(layers) for w in ("weight", "bias")}
    published |= {f"{i}.{layers}.weight" for i in range(3)}
    assert set(heads.heads.state_dict()) == published

    loaded_heads = load_medusa(tmp_path, 16, 40)
    hidden = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded_heads(hidden), heads(hidden), rtol=0, atol=0)
        assert loaded_heads(hidden).shape == (3, 5, 40)
        # ResBlock is x + SiLU(Wx + b), then the head's lm_head
        block, lm = heads.heads[1][0], heads.heads[1][layers]
        manual = hidden + torch.nn.functional.silu(hidden @ block.linear.weight.T + block.linear.bias)
        if layers == 1:
            torch.testing.assert_close(heads(hidden)[1], manual @ lm.weight.T)

    nodes = MedusaMethod(loaded_heads, mc_sim_7b_63).scored_tree(9, hidden[0], depth=loaded_heads.num_heads)
    tree = nodes.tree(list(range(1, len(nodes.tokens))))
    assert int(tree.tokens[0]) == 9 and int(tree.depth.max()) == 3  # 3 heads: depth-4 choices dropped
    assert len(nodes.tokens) - 1 == sum(len(c) <= 3 for c in mc_sim_7b_63)
    with torch.no_grad():
        logp = torch.log_softmax(heads(hidden[0]), -1)
    ranked = torch.topk(logp, 10).indices.tolist()
    for node in range(1, len(nodes.tokens)):  # node (ranks r_0..r_d) carries head d's rank r_d, scored by the path
        path, depth = nodes.paths[node], nodes.depths[node]
        assert nodes.tokens[node] == ranked[depth - 1][path[-1]]
        want = sum(float(logp[d, ranked[d][r]]) for d, r in enumerate(path))
        assert abs(nodes.scores[node] - want) < 1e-4


def test_compact_medusa_scores_like_the_full_heads_restricted_to_the_draft_vocabulary(tmp_path):
    torch.manual_seed(1)
    full = MedusaHeads(16, 40, num_heads=2, num_layers=1)
    full.restrict_vocab(torch.tensor([31, 2, 17, 5, 9]))
    save_medusa(full, tmp_path / "full")
    save_medusa(full, tmp_path / "compact", vocab_rows_only=True)
    compact = load_medusa(tmp_path / "compact", 16, 40)
    assert compact.rows_only and compact.heads[0][-1].weight.shape == (5, 16)
    assert json.loads((tmp_path / "compact" / "config.json").read_text())["vocab_size"] == 40
    hidden = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compact(hidden), load_medusa(tmp_path / "full", 16, 40)(hidden), rtol=0, atol=0)
    choices = [[0], [1], [2], [4], [0, 0], [0, 4], [4, 0], [5], [5, 0]]  # rank 5: beyond the 5-token vocabulary
    trees = [MedusaMethod(h, choices).scored_tree(7, hidden[0], 2) for h in (compact, full)]
    assert trees[0].tokens == trees[1].tokens and trees[0].scores == trees[1].scores
    assert len(trees[0].tokens) == 1 + 7 and all(token in (2, 5, 9, 17, 31) for token in trees[0].tokens[1:])
    bf16 = load_medusa(tmp_path / "compact", 16, 40, dtype=torch.bfloat16)
    assert bf16._subset_weights[0].dtype == torch.bfloat16
    (tmp_path / "compact" / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 2, 3]}))
    with pytest.raises(ValueError, match="5 rows, neither the vocabulary of 40 tokens nor a draft vocabulary"):
        load_medusa(tmp_path / "compact", 16, 40)


def test_medusa_mismatch_errors(tmp_path):
    save_medusa(MedusaHeads(16, 40, num_heads=2), tmp_path)
    with pytest.raises(ValueError, match="hidden size 16.*has 32"):
        load_medusa(tmp_path, 32, 40)
    with pytest.raises(ValueError, match="vocabulary of 40 tokens.*has 50"):
        load_medusa(tmp_path, 16, 50)
    with pytest.raises(FileNotFoundError):
        load_medusa(tmp_path / "missing", 16, 40)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 3}))
    with pytest.raises(ValueError, match="missing"):
        load_medusa(tmp_path, 16, 40)
