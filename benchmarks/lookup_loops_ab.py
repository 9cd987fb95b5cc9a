"""Prompt lookup continuing a loop past the end of the text (`ngram.loop_continuation`) against stopping where
the text ends, in one process, alternated prompt by prompt.

    python benchmarks/lookup_loops_ab.py --prompts 10
    python benchmarks/lookup_loops_ab.py --model llama-3.2-1b-q4_0.gguf --sets general --prompts 4

`--sets` picks from general (benchmarks/general_questions.jsonl), humaneval (../shared/data) and open-ended
(benchmarks/open_ended_prompts.jsonl). Each prompt (128 tokens, greedy) runs once each way, the order swapped from
one prompt to the next; the "stop" side swaps the module's `loop_continuation` for a plain slice of the text.
Outputs are checked equal; tokens/s and tau (tokens per target forward) per side.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from kernel_ab import HERE, HUMANEVAL  # this folder is on the path when a script in it runs

from specserve.config import DeploymentConfig, build_engine
from specserve.models.loader import load_model
from specserve.speculative import ngram
from specserve.speculative.sampling import SamplingParams

SETS = {"general": HERE / "general_questions.jsonl", "humaneval": HUMANEVAL,
        "open-ended": HERE / "open_ended_prompts.jsonl"}
SIDES = {"loop": ngram.loop_continuation, "stop": lambda tokens, start, n, max_len: tokens[start:start + max_len]}


def compare(engine, prompts: list[str], params: SamplingParams) -> str:
    seconds, tokens, forwards = dict.fromkeys(SIDES, 0.0), dict.fromkeys(SIDES, 0), dict.fromkeys(SIDES, 0)
    outputs: dict[tuple[str, int], list[int]] = {}
    for i, prompt in enumerate(prompts):
        for side in list(SIDES)[::1 if i % 2 == 0 else -1]:
            ngram.loop_continuation = SIDES[side]
            metrics = (result := engine.generate(prompt, params)).metrics
            seconds[side] += metrics.total_time_s
            tokens[side] += metrics.output_tokens
            forwards[side] += metrics.target_forwards
            outputs[side, i] = result.token_ids
    ngram.loop_continuation = SIDES["loop"]
    equal = sum(outputs["loop", i] == outputs["stop", i] for i in range(len(prompts)))
    speed = {side: tokens[side] / seconds[side] for side in SIDES}
    return " ".join(f"{side} {speed[side]:.1f} tok/s (tau {tokens[side] / forwards[side]:.2f})," for side in SIDES) + \
        f" -> loop is {speed['loop'] / speed['stop']:.3f}x; outputs equal {equal}/{len(prompts)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or checkpoint (default: the embedded one)")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--sets", default="general,humaneval,open-ended")
    parser.add_argument("--prompts", type=int, default=10)
    args = parser.parse_args()
    target, base = load_model(args.model), DeploymentConfig()
    engine = build_engine(replace(base, speculative=base.speculative.with_method(args.method)), target)
    params = SamplingParams(max_tokens=128)
    for name in args.sets.split(","):
        lines = SETS[name].read_text().splitlines()[:args.prompts]
        prompts = [json.loads(line)["turns"][0] for line in lines]
        engine.generate(prompts[0], params)  # warm-up, then forgotten
        engine.forget_requests()
        print(f"{args.method} {name}: {compare(engine, prompts, params)}", flush=True)


if __name__ == "__main__":
    main()
