"""ScreenChoice: a greedy lm_head call reads the screen or the plain lm_head, whichever its measured times favour;
the outputs are the same either way."""

from __future__ import annotations

import time

import torch

from specserve.engine.engine import Engine
from specserve.models import quant
from specserve.models.loader import load_model
from specserve.models.screen_choice import ScreenChoice
from specserve.speculative.sampling import SamplingParams


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_calls(choice: ScreenChoice, clock: Clock, rows: int, calls: int, screen_s: float, plain_s: float) -> list[bool]:
    """`calls` calls of `rows` rows whose screen takes screen_s and plain lm_head plain_s; the paths taken."""
    taken = []
    for _ in range(calls):
        screen = choice.uses_screen(rows)
        seconds = screen_s if screen else plain_s
        choice.timed(rows, screen, lambda s=seconds: setattr(clock, "now", clock.now + s))
        taken.append(screen)
    return taken


def test_a_screen_dearer_than_the_plain_lm_head_is_left_and_probed():
    clock = Clock()
    choice = ScreenChoice(clock=clock)
    taken = run_calls(choice, clock, 1, 40, screen_s=0.016, plain_s=0.010)
    assert taken[:2] == [True, False]  # each path read once
    assert sum(taken[2:]) == sum(1 for calls in range(2, 40) if calls % choice.probe_every == 0)
    # the rows become peaked: the next probe sees the screen cheap again, and it is kept
    taken = run_calls(choice, clock, 1, 40, screen_s=0.006, plain_s=0.010)  # calls 40..79
    assert not taken[5] and all(taken[20:24]) and not taken[24] and all(taken[25:])  # call 64: a plain refresh


def test_a_cheaper_screen_is_kept_and_the_plain_time_refreshed():
    clock = Clock()
    choice = ScreenChoice(clock=clock)
    taken = run_calls(choice, clock, 3, 200, screen_s=0.008, plain_s=0.010)
    plain_calls = [i for i, screen in enumerate(taken) if not screen]
    assert plain_calls == [1, 64, 128, 192]


def test_ties_within_the_margin_keep_the_screen():
    clock = Clock()
    choice = ScreenChoice(clock=clock)
    taken = run_calls(choice, clock, 2, 30, screen_s=0.0105, plain_s=0.010)
    assert all(taken[2:])


def test_row_counts_are_followed_apart():
    clock = Clock()
    choice = ScreenChoice(clock=clock)
    assert [ScreenChoice.bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 6]
    run_calls(choice, clock, 8, 20, screen_s=0.05, plain_s=0.02)  # 8 rows: plain wins
    taken = run_calls(choice, clock, 1, 20, screen_s=0.006, plain_s=0.010)  # 1 row: the screen wins
    assert sum(taken) == 19
    assert not choice.uses_screen(7) and choice.uses_screen(1)


def test_a_slow_screen_is_left_and_the_outputs_do_not_change(checkpoint, monkeypatch):
    """Greedy decoding with a screen made slow: most calls go to the plain lm_head, and every path gives the tokens
    of the full logits."""
    target = load_model(checkpoint("llama"), dtype=torch.bfloat16, quantization="int8")
    model = target.model
    assert model.greedy_screen is not None
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog. The lazy"
    monkeypatch.setenv("SPECSERVE_GREEDY_SCREEN", "0")
    want = Engine(target).generate(prompt, params).token_ids
    monkeypatch.setenv("SPECSERVE_GREEDY_SCREEN", "1")
    screened = []
    real = quant.screen_argmax

    def slow_screen(*args):
        screened.append(1)
        time.sleep(0.02)
        return real(*args)

    monkeypatch.setattr("specserve.models.transformer.screen_argmax", slow_screen)
    got = Engine(target).generate(prompt, params).token_ids
    assert got == want
    calls = sum(model.screen_choice.calls.values())
    assert calls >= 24 and len(screened) <= 2 + calls // model.screen_choice.probe_every
