"""Greedy choices through the 5-bit screen of an 8-bit lm_head (quant_linear.cpp's screen_argmax): always
torch.argmax of the logits the full kernel computes, on every ISA path this CPU runs, and the same outputs
through the engine with the screen on and off."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.engine import Engine
from specserve.models import cpu_kernels, quant
from specserve.models.loader import load_model
from specserve.models.transformer import GREEDY_SCREEN, GreedyChoices
from specserve.speculative.ngram import NGramMethod
from specserve.speculative.sampling import SamplingParams

from .test_quant import isa_paths, packed_weight


def rows_near_the_weight(weight: torch.Tensor, count: int, seed: int, peak: float = 30.0) -> torch.Tensor:
    """Activations aimed at random output rows, plus noise: peaked logits with close runners-up, as a language
    model's are (pure noise gives flat logits, where the screen keeps most tiles)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, weight.shape[0], (count,), generator=g)
    noise = torch.randn(count, weight.shape[1], generator=g)
    scale = torch.rand(count, 1, generator=g) * 4
    return (weight[picks] / weight[picks].norm(dim=-1, keepdim=True) * peak + noise * scale).bfloat16()


@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("kind, rows, cols", [("Q8_0", 1000, 512), ("int8", 80, 64), ("Q8_0", 4096, 128)])
def test_screen_argmax_is_the_argmax_of_the_full_logits(kind, rows, cols, isa, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, isa)
    packed, dense = packed_weight(kind, rows=rows, cols=cols)
    screen = packed.greedy_screen()
    for count, peak in ((1, 30), (2, 3), (5, 30), (8, 3), (9, 30), (17, 3), (64, 10)):  # one pass, several
        x = rows_near_the_weight(dense, count, seed=count, peak=peak)  # passes, decoded-once tiles past 8 rows
        want = cpu_kernels.argmax(packed.matmul(x, out_fp32=True))
        assert torch.equal(want, packed.matmul(x, out_fp32=True).argmax(-1))
        assert torch.equal(quant.screen_argmax(x, packed, screen), want)
        assert torch.equal(quant.screen_argmax(x.float(), packed, screen), cpu_kernels.argmax(
            packed.matmul(x.float(), out_fp32=True)))


def test_the_exact_pass_is_needed():
    """Control: the screen's own estimate (its products, times 8) picks another token on some of these rows, so
    the test above would catch a screen_argmax that skipped its exact pass or kept too few candidates."""
    packed, dense = packed_weight("Q8_0", rows=4096, cols=128)
    screen = packed.greedy_screen()
    x = rows_near_the_weight(dense, 64, seed=7, peak=3)
    estimate = (screen.matmul(x, out_fp32=True) * 8).argmax(-1)
    want = packed.matmul(x, out_fp32=True).argmax(-1)
    assert not torch.equal(estimate, want)
    assert torch.equal(quant.screen_argmax(x, packed, screen), want)


@pytest.mark.parametrize("isa", isa_paths())
def test_ties_and_non_finite_rows_answer_as_torch_argmax(isa, monkeypatch):
    """Equal logits: the first index wins. A NaN in a row: its first NaN. An infinite activation: whatever the
    full logits give (every tile of that row is computed)."""
    monkeypatch.setenv(cpu_kernels.ENV, isa)
    weight = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    weight[150] = weight[37]  # two outputs with the same codes and scales: their logits tie exactly
    packed = quant.PackedWeight.from_codes(quant.quantize_dense(weight, "int8"))
    x = torch.stack([weight[37] * 8, torch.zeros(64), weight[5], weight[5]]).bfloat16()
    x[2, 3] = float("nan")
    x[3, 9] = float("inf")
    logits = packed.matmul(x, out_fp32=True)
    screen = packed.greedy_screen()
    got = quant.screen_argmax(x, packed, screen)
    assert torch.equal(got, cpu_kernels.argmax(logits))
    assert got[0] == 37 and got[1] == 0
    for row in range(len(x)):  # alone, without the other rows' candidate tiles (a NaN garbles psum16, not p)
        assert quant.screen_argmax(x[row:row + 1], packed, screen) == got[row]


def test_only_8_bit_weights_have_a_screen():
    assert packed_weight("Q5_0", rows=32, cols=64)[0].greedy_screen() is None
    assert packed_weight("int4", rows=32, cols=64)[0].greedy_screen() is None
    screen = packed_weight("Q8_0", rows=32, cols=64)[0].greedy_screen()
    assert (screen.bits, screen.zero, screen.kind) == (5, 16, "Q8_0 screen")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_outputs_are_the_same_with_the_screen_on_and_off(family, checkpoint, monkeypatch):
    """A tied int8 lm_head is screened: plain and n-gram decoding give the tokens they give with full logits,
    and the screen did run."""
    target = load_model(checkpoint(family), dtype=torch.bfloat16, quantization="int8")
    model = target.model
    assert model.greedy_screen is not None
    calls = []
    real = quant.screen_argmax
    monkeypatch.setattr("specserve.models.transformer.screen_argmax",
                        lambda *args: calls.append(1) or real(*args))
    params = SamplingParams(max_tokens=24)
    prompts = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The lazy"]
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(GREEDY_SCREEN, setting)
        for prompt in prompts:
            for name, engine in (("plain", Engine(target)), ("ngram", Engine(target, NGramMethod(1, 3), 4))):
                outputs[setting, name, prompt] = engine.generate(prompt, params).token_ids
        assert bool(calls) == (setting == "1")
    assert all(outputs["0", name, p] == outputs["1", name, p] for name in ("plain", "ngram") for p in prompts)
    assert all(outputs["1", "ngram", p] == outputs["1", "plain", p] for p in prompts)


def test_greedy_choices_are_refused_where_logits_are_needed():
    """Sampling (or a grammar) must see logits: GreedyChoices cannot stand in for them."""
    from specserve.speculative.tree import Chain
    from specserve.speculative.verify import verify

    choices = GreedyChoices(torch.tensor([3, 4]))
    tree = Chain(9, [3])  # root 9, draft [3]: row 0 chooses 3 (accepted), row 1 chooses 4
    assert verify(tree, choices, SamplingParams(), torch.Generator()).tokens == [3, 4]
    with pytest.raises(ValueError, match="greedy choices"):
        verify(tree, choices, SamplingParams(temperature=1.0), torch.Generator())
