"""The greedy screen of the 8-bit lm_head (docs/quantization.md) on and off, in one process, on the default model.

    python benchmarks/greedy_screen_ab.py engine --methods ar,ngram --prompts 5
    python benchmarks/greedy_screen_ab.py lm_head --rows 1,2,3,5,8,16,40

`engine`: the first N general questions and the first N HumanEval prompts (128 tokens, greedy) through
`Engine.generate`, screen on and off (SPECSERVE_GREEDY_SCREEN) alternated pass by pass; outputs checked equal.
`lm_head`: the final hidden states of a real text's first tokens (kernel_ab.final_states), then the lm_head's greedy
choice for R of them at once, full logits + argmax against `screen_argmax`, alternated round by round; answers
checked equal.
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
from specserve.models.transformer import GREEDY_SCREEN
from specserve.speculative.sampling import SamplingParams


def engine_ab(target, methods: list[str], questions: list[str]) -> None:
    base = DeploymentConfig()
    params = SamplingParams(max_tokens=128)
    for method in methods:
        engine = build_engine(replace(base, speculative=base.speculative.with_method(method)), target)
        engine.generate(questions[0], SamplingParams(max_tokens=16))
        outputs, seconds, tokens = {}, {"0": 0.0, "1": 0.0}, {"0": 0, "1": 0}
        for round_ in range(2):
            for setting in ("1", "0") if round_ == 0 else ("0", "1"):
                os.environ[GREEDY_SCREEN] = setting
                for i, question in enumerate(questions):
                    result = engine.generate(question, params)
                    outputs.setdefault((setting, i), result.token_ids)
                    seconds[setting] += result.metrics.total_time_s
                    tokens[setting] += result.metrics.output_tokens
        equal = sum(outputs["0", i] == outputs["1", i] for i in range(len(questions)))
        off, on = (tokens[s] / seconds[s] for s in ("0", "1"))
        print(f"{method}: outputs equal {equal}/{len(questions)}; screen off {off:.1f} tok/s, on {on:.1f} "
              f"({on / off:.3f}x)")


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
    parser.add_argument("kind", choices=("engine", "lm_head"))
    parser.add_argument("--methods", default="ar,ngram")
    parser.add_argument("--prompts", type=int, default=5, help="engine: prompts from each set")
    parser.add_argument("--rows", default="1,2,3,5,8,16,40")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    target = load_model()
    if args.kind == "engine":
        engine_ab(target, args.methods.split(","), prompts(args.prompts))
    else:
        lm_head_ab(target, [int(r) for r in args.rows.split(",")], args.rounds)


if __name__ == "__main__":
    main()
