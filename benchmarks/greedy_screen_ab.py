"""The greedy screen of the 8-bit lm_head (docs/quantization.md) on and off, in one process, on the default model.

    python benchmarks/greedy_screen_ab.py engine --methods ar,ngram --prompts 5
    python benchmarks/greedy_screen_ab.py lm_head --rows 1,2,3,5,8,16,40
    python benchmarks/greedy_screen_ab.py choice --methods ar,ngram --prompts 5
    python benchmarks/greedy_screen_ab.py choice --methods ar,ngram --prompts 5 --random-prompts
    python benchmarks/greedy_screen_ab.py flat --rows 1,2,4,8

`engine`: the first N general questions and the first N HumanEval prompts (128 tokens, greedy) through
`Engine.generate`, screen on and off (SPECSERVE_GREEDY_SCREEN) alternated pass by pass; outputs checked equal.
`lm_head`: the final hidden states of a real text's first tokens (kernel_ab.final_states), then the lm_head's greedy
choice for R of them at once, full logits + argmax against `screen_argmax`, alternated round by round; answers
checked equal.
`choice`: the prompts of `engine`, or N prompts of 64 random tokens (fixed seed), where the model has no clear
favourite, through `Engine.generate` (128 tokens, greedy): screen off, the screen on every call, and the default
(each call on the path its measured times favour, models/screen_choice.py), in turns; outputs checked equal.
`flat`: forwards of R random tokens after 300 cached ones (flat rows: the screen keeps most tiles), full logits
against greedy forwards with the screen on every call and with the default choice, in turns; answers checked equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

import torch
from kernel_ab import final_states, prompts, timed  # this folder is on the path when a script in it runs

from specserve.config import DeploymentConfig, build_engine
from specserve.models import cpu_kernels, quant
from specserve.models.loader import load_model
from specserve.models.transformer import GREEDY_SCREEN, GreedyChoices
from specserve.speculative.sampling import SamplingParams


def in_turns(names: list[str], round_: int) -> list[str]:
    """The order of `names` in round `round_`: each round starts one further along."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def generate_in_turns(engine, questions: list[str], settings: dict, rounds: int, warm_rounds: int = 0):
    """Each question through `engine` under each setting (a callable that applies it), settings in turns round by
    round; the first `warm_rounds` rounds are not timed. Returns the outputs by (setting, question index) and each
    setting's tokens/s."""
    outputs, seconds, tokens = {}, dict.fromkeys(settings, 0.0), dict.fromkeys(settings, 0)
    params = SamplingParams(max_tokens=128)
    for round_ in range(rounds):
        for name in in_turns(list(settings), round_):
            settings[name]()
            for i, question in enumerate(questions):
                result = engine.generate(question, params)
                outputs.setdefault((name, i), result.token_ids)
                if round_ >= warm_rounds:
                    seconds[name] += result.metrics.total_time_s
                    tokens[name] += result.metrics.output_tokens
    return outputs, {name: tokens[name] / seconds[name] for name in settings}


def screen_setting(value: str, choice=None, margin: float | None = None):
    """A setting for generate_in_turns: SPECSERVE_GREEDY_SCREEN = value and, with `choice`, its margin."""
    def apply() -> None:
        os.environ[GREEDY_SCREEN] = value
        if choice is not None:
            choice.margin = margin
    return apply


def engine_ab(target, methods: list[str], questions: list[str]) -> None:
    base = DeploymentConfig()
    for method in methods:
        engine = build_engine(replace(base, speculative=base.speculative.with_method(method)), target)
        engine.generate(questions[0], SamplingParams(max_tokens=16))
        outputs, rates = generate_in_turns(engine, questions, {"1": screen_setting("1"), "0": screen_setting("0")}, 2)
        equal = sum(outputs["0", i] == outputs["1", i] for i in range(len(questions)))
        off, on = rates["0"], rates["1"]
        print(f"{method}: outputs equal {equal}/{len(questions)}; screen off {off:.1f} tok/s, on {on:.1f} "
              f"({on / off:.3f}x)")


def random_prompts(tokenizer, count: int, length: int = 64) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    return [tokenizer.decode(torch.randint(1000, vocab, (length,), generator=generator).tolist())
            for _ in range(count)]


def choice_ab(target, methods: list[str], questions: list[str]) -> None:
    choice = target.model.screen_choice
    margin = choice.margin
    settings = {"off": screen_setting("0", choice, margin), "screen always": screen_setting("1", choice, float("inf")),
                "chosen": screen_setting("1", choice, margin)}
    base = DeploymentConfig()
    for method in methods:
        engine = build_engine(replace(base, speculative=base.speculative.with_method(method)), target)
        outputs, rates = generate_in_turns(engine, questions, settings, 3, warm_rounds=1)
        equal = all(outputs[name, i] == outputs["off", i] for name in settings for i in range(len(questions)))
        print(f"{method}: outputs equal: {equal}; " + ", ".join(
            f"{name} {rate:.1f} tok/s ({rate / rates['off']:.3f}x off)" for name, rate in rates.items()))
    os.environ[GREEDY_SCREEN], choice.margin = "1", margin


def flat_ab(target, rows: list[int], rounds: int) -> None:
    from specserve.models.kv_cache import KVCache

    model = target.model
    choice = model.screen_choice
    margin = choice.margin
    os.environ[GREEDY_SCREEN] = "1"
    generator = torch.Generator().manual_seed(0)
    times: dict[tuple[str, int], list[float]] = {}
    for count in rows:
        cache = KVCache.for_model(model, 1, 300 + count + 1)
        cache.lengths[0] = 300
        positions = torch.arange(300, 300 + count)[None]
        tokens = torch.randint(1000, model.spec.vocab_size, (1, count), generator=generator)

        def forward(greedy: bool) -> torch.Tensor:  # each row's argmax, from GreedyChoices or full logits
            out = model(tokens, positions, cache, positions, greedy=greedy).logits
            return out.ids[0] if isinstance(out, GreedyChoices) else cpu_kernels.argmax(out[0])

        cases = {"full": (False, margin), "screen": (True, float("inf")), "chosen": (True, margin)}  # greedy, margin
        answers = []
        for round_ in range(rounds):
            for name in in_turns(list(cases), round_):
                greedy, choice.margin = cases[name]
                answers.append(forward(greedy))
                times.setdefault((name, count), []).append(timed(lambda: forward(greedy), calls=5))
        assert all(torch.equal(a, answers[0]) for a in answers), f"{count} rows: answers differ"
    choice.margin = margin
    for count in rows:
        full, screened, chosen = (statistics.median(times[name, count]) * 1e3 for name in ("full", "screen", "chosen"))
        print(f"{count:3d} random rows: full-logits forward {full:.2f} ms, screen always {screened:.2f} ms "
              f"({screened / full:.2f}x), chosen {chosen:.2f} ms ({chosen / full:.2f}x)")


def lm_head_ab(target, rows: list[int], rounds: int) -> None:
    model = target.model
    # a real text's states: on random ones the screen keeps nearly every tile
    hidden = final_states(model, target.tokenizer, max(rows))
    os.environ[GREEDY_SCREEN] = "1"
    weight, screen = model.lm_head_packed, model.greedy_screen
    cases = {"full": lambda h: cpu_kernels.argmax(weight.matmul(h, out_fp32=True)),
             "screen": lambda h: quant.screen_argmax(h, weight, screen)}
    for count in rows:
        assert torch.equal(cases["full"](hidden[:count]), cases["screen"](hidden[:count]))
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds):
        for name in ("full", "screen") if round_ % 2 == 0 else ("screen", "full"):
            for count in rows:
                times.setdefault((name, count), []).append(timed(lambda: cases[name](hidden[:count]), calls=5))
    for count in rows:
        full, screened = (statistics.median(times[name, count]) * 1e3 for name in ("full", "screen"))
        print(f"{count:3d} rows: full logits + argmax {full:.2f} ms, screen_argmax {screened:.2f} ms "
              f"({full / screened:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("engine", "lm_head", "choice", "flat"))
    parser.add_argument("--methods", default="ar,ngram")
    parser.add_argument("--prompts", type=int, default=5, help="engine, choice: prompts from each set (or random ones)")
    parser.add_argument("--random-prompts", action="store_true", help="choice: random-token prompts")
    parser.add_argument("--rows", default="1,2,3,5,8,16,40")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    target = load_model()
    if args.kind == "engine":
        engine_ab(target, args.methods.split(","), prompts(args.prompts))
    elif args.kind == "choice":
        questions = (random_prompts(target.tokenizer, args.prompts) if args.random_prompts
                     else prompts(args.prompts))
        choice_ab(target, args.methods.split(","), questions)
    elif args.kind == "flat":
        flat_ab(target, [int(r) for r in args.rows.split(",")], args.rounds)
    else:
        lm_head_ab(target, [int(r) for r in args.rows.split(",")], args.rounds)


if __name__ == "__main__":
    main()
