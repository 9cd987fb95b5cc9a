"""The KV cache: rollback by length, compaction of an accepted path, masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.models.kv_cache import KVCache


def run(model, cache, tokens, start):
    positions = torch.arange(start, start + len(tokens))[None]
    return model(torch.tensor([tokens]), positions, cache, positions).logits[0]


def test_rollback_discards_rejected_tokens(loaded):
    model = loaded("llama").model
    prompt = [1, 40, 41, 42, 43]
    clean, dirty = KVCache.for_model(model, 1, 32), KVCache.for_model(model, 1, 32)
    run(model, clean, prompt, 0)
    run(model, dirty, prompt, 0)
    clean.lengths[0] = dirty.lengths[0] = 5
    run(model, clean, [50], 5)
    clean.lengths[0] = 6
    run(model, dirty, [50, 99, 98, 97], 5)  # three rejected drafts written after the accepted token
    dirty.lengths[0] = 6
    want, got = run(model, clean, [60, 61], 6), run(model, dirty, [60, 61], 6)
    torch.testing.assert_close(got, want)
    for layer in range(len(clean.keys)):
        torch.testing.assert_close(dirty.keys[layer][:, :, :8], clean.keys[layer][:, :, :8])


def test_compact_moves_an_accepted_path_into_place():
    cache = KVCache(2, 1, 1, 10, 2, torch.float32)
    for layer in range(2):
        cache.keys[layer][0, 0, :, 0] = torch.arange(10.0)
        cache.values[layer][0, 0, :, 1] = torch.arange(10.0) * 10
    cache.compact(0, torch.tensor([4, 6, 9]), 3)
    assert cache.keys[1][0, 0, :7, 0].tolist() == [0, 1, 2, 4, 6, 9, 6]
    assert cache.values[0][0, 0, 3:6, 1].tolist() == [40, 60, 90]


def test_mask_hides_stale_slots_and_applies_the_sliding_window():
    cache = KVCache(1, 1, 1, 16, 2, torch.float32)
    cache.lengths[0] = 6
    positions = torch.tensor([[6, 7]])
    masks = cache.attention_masks(positions, positions, None, sliding_window=4)
    full = masks["full_attention"][0, 0]
    assert full[0].tolist() == [True] * 7 + [False]
    assert full[1].tolist() == [True] * 8
    assert masks["sliding_attention"][0, 0, 1].tolist() == [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="overflow"):
        cache.attention_masks(torch.tensor([[16]]), torch.tensor([[16]]), None, None)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_mask_kernel_equals_the_torch_masks(data):
    """The one-pass kernel against masks_by_torch: rows of other lengths (a padded row: length 0 or past its new
    tokens), chains and trees, new tokens at scattered slots, with and without a sliding window."""
    rows, tokens = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8))
    capacity = 48
    cache = KVCache(1, rows, 1, capacity, 2, torch.float32)
    slots, positions = [], []
    for row in range(rows):
        length = data.draw(st.integers(0, capacity - tokens))
        cache.lengths[row] = data.draw(st.sampled_from([length, 0, capacity]))
        row_slots = data.draw(st.permutations(range(length, capacity))) [:tokens]
        slots.append(row_slots)
        positions.append([length + data.draw(st.integers(0, 3)) + i for i in range(tokens)])
    slots, positions = torch.tensor(slots), torch.tensor(positions)
    tree = None
    if data.draw(st.booleans()):
        tree = torch.rand(rows, tokens, tokens, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
        tree = (tree < 0.5) | torch.eye(tokens, dtype=torch.bool)
    window = data.draw(st.sampled_from([None, 1, 4, 16]))
    got = cache.attention_masks(positions, slots, tree, window)
    want = cache.masks_by_torch(positions, slots, tree, window, int(slots.max()) + 1)
    for kind in ("full_attention", "sliding_attention"):
        assert torch.equal(got[kind], want[kind]), kind
