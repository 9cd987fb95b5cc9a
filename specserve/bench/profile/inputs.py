"""`specserve profile`'s inputs: the genai-perf input file, the planned requests (prompts and sampled output
lengths) and their sampling fields."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.jsonl import read_jsonl
from specserve.bench.profile.config import ProfileConfig, ProfileError

DEFAULT_TENSORRTLLM_MAX_TOKENS = 256  # genai-perf sends this when --output-tokens-mean is not given


def load_input_file(path: str | Path) -> list[str]:
    """genai-perf's file input: JSONL, one object a line with a "text" (or "text_input") string; blank lines are
    skipped. Raises ProfileError naming the line."""
    path = Path(path)
    prompts: list[str] = []
    for number, record in read_jsonl(path, ProfileError, hint='; expected one {"text": "..."} object a line'):
        if not isinstance(record, dict):
            raise ProfileError(f'{path}:{number}: expected a JSON object like {{"text": "..."}}')
        text = record.get("text", record.get("text_input"))
        if text is None and "turns" in record:
            raise ProfileError(f"{path}:{number}: this is an EAGLE / MT-bench question.jsonl line; convert the file "
                               "first: specserve convert-dataset --input_file QUESTIONS --output_file CONVERTED")
        if not isinstance(text, str) or not text:
            raise ProfileError(f"{path}:{number}: expected a non-empty string in 'text' (or 'text_input')")
        prompts.append(text)
    if not prompts:
        raise ProfileError(f"input file {path} has no prompts (it is empty)")
    return prompts


@dataclass
class PlannedRequest:
    index: int  # position in the run (warm-up requests: -1, -2, ...)
    prompt_index: int
    prompt: str
    max_tokens: int | None
    min_tokens: int | None = None

    def input_hash(self, extra_inputs: dict) -> str:
        key = {"prompt": self.prompt, "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
               "extra_inputs": extra_inputs}
        return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def sample_output_tokens(rng: random.Random, mean: int, stddev: float) -> int:
    """genai-perf's bounded normal (lower bound 1), rounded down."""
    if stddev <= 0:
        return int(mean)
    return max(1, int(rng.gauss(mean, stddev)))


def plan_requests(prompts: list[str], config: ProfileConfig) -> tuple[list[PlannedRequest], list[PlannedRequest]]:
    """(warm-up requests, measured requests). Prompts are taken in file order (cycling past the end), the measured
    ones from the first prompt on, so two runs with the same file and flags send the same inputs."""
    def make(index: int, position: int, rng: random.Random) -> PlannedRequest:
        prompt_index = position % len(prompts)
        max_tokens = None
        if config.output_tokens_mean is not None:
            max_tokens = sample_output_tokens(rng, config.output_tokens_mean, config.output_tokens_stddev)
        elif config.service_kind == "triton" and config.backend == "tensorrtllm":
            max_tokens = DEFAULT_TENSORRTLLM_MAX_TOKENS
        min_tokens = max_tokens if config.output_tokens_mean_deterministic else None
        return PlannedRequest(index, prompt_index, prompts[prompt_index], max_tokens, min_tokens)

    measured_rng, warmup_rng = random.Random(config.random_seed), random.Random(config.random_seed + 1)
    warmup = [make(-(i + 1), i, warmup_rng) for i in range(config.warmup_request_count)]
    measured = [make(i, i, measured_rng) for i in range(config.request_count)]
    return warmup, measured


def sampling_fields(req: "PlannedRequest", greedy: bool, names: dict | None = None, temperature=0.0) -> dict:
    """The request's planned max / min tokens and, when greedy, a zero temperature, under the style's names."""
    fields = {"max_tokens": req.max_tokens, "min_tokens": req.min_tokens,
              "temperature": temperature if greedy else None}
    names = names or {}
    return {names.get(key, key): value for key, value in fields.items() if value is not None}
