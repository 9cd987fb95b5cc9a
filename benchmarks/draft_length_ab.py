"""Fixed draft lengths against the adaptive draft-length choice, one request at a time, in one process.

    python benchmarks/draft_length_ab.py --dataset benchmarks/general_questions.jsonl --prompts 20 \
        --variants fixed:4,adaptive:4,adaptive:6:5

Each variant is an engine over the same loaded default model: `fixed:K` drafts K tokens at every step
(`adaptive_draft_len: false`); `adaptive:K[:N]` chooses up to K per step (the default), N is `prompt_lookup_max`.
`+KEY=VALUE` after a variant sets one of the method's `speculative_config` keys, e.g. an EAGLE head's weights on the
kernels: `--method eagle3 --variants adaptive:6,adaptive:6+quantization=int4`.
Every prompt (128 tokens, greedy) goes through every variant before the next prompt, so a slow phase of the machine
hits them all. Each engine gets one untimed warm-up request, then forgets what it learnt from it. Outputs are
checked equal to the first variant's, and each variant's tokens/s is reported relative to the first.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from specserve.config import DeploymentConfig, build_engine
from specserve.models.loader import load_model
from specserve.speculative.sampling import SamplingParams


def engine_for(target, base: DeploymentConfig, method: str, variant: str):
    lengths, *keys = variant.split("+")
    kind, *numbers = lengths.split(":")
    if kind not in ("fixed", "adaptive") or not 1 <= len(numbers) <= 2 or not all("=" in key for key in keys):
        raise SystemExit(f"a variant is fixed:K or adaptive:K[:N], then +KEY=VALUE settings, got {variant!r}")
    spec = base.speculative.with_method(method)
    settings = {**spec.settings, **dict(key.split("=", 1) for key in keys)}
    if len(numbers) == 2:
        settings["prompt_lookup_max"] = int(numbers[1])
    spec = replace(spec, max_draft_len=int(numbers[0]), adaptive_draft_len=kind == "adaptive", settings=settings)
    return build_engine(replace(base, speculative=spec), target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", type=Path, default=Path(__file__).parent / "general_questions.jsonl")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--variants", default="fixed:4,adaptive:4")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    base, target = DeploymentConfig(), load_model()
    variants = args.variants.split(",")
    engines = {variant: engine_for(target, base, args.method, variant) for variant in variants}
    lines = args.dataset.read_text().splitlines()[:args.prompts]
    prompts = [json.loads(line)["turns"][0] for line in lines]
    params = SamplingParams(max_tokens=args.max_tokens)
    for engine in engines.values():
        engine.generate(prompts[0], params)
        engine.forget_requests()
    seconds = dict.fromkeys(variants, 0.0)
    outputs: dict[str, list[list[int]]] = {variant: [] for variant in variants}
    for prompt in prompts:
        for variant, engine in engines.items():
            result = engine.generate(prompt, params)
            seconds[variant] += result.metrics.total_time_s
            outputs[variant].append(result.token_ids)
    first = variants[0]
    tokens = sum(map(len, outputs[first]))
    for variant in variants:
        equal = sum(a == b for a, b in zip(outputs[variant], outputs[first]))
        print(f"{variant:28s} {tokens / seconds[variant]:8.2f} tok/s  {seconds[first] / seconds[variant]:.3f}x "
              f"{first}  outputs equal {equal}/{len(prompts)}")


if __name__ == "__main__":
    main()
