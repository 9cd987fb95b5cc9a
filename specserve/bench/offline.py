"""Offline benchmark: every method, plain decoding and HF transformers on the same prompts, in one run.

Concurrency 1, greedy. Each method runs every prompt once after a warm-up request; tokens/s is total output
tokens over total wall time, so ratios between methods are side by side on the same machine and prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench.jsonl import read_jsonl
from specserve.config import ConfigError, DeploymentConfig, build_engine, method_variant
from specserve.models.loader import LoadedModel
from specserve.spec.sampling import SamplingParams

HF_METHODS = ("hf", "hf-pld")


def load_prompts(path: Path, limit: int | None = None) -> list[str]:
    """EAGLE/MT-bench question.jsonl (first turn) or genai-perf JSONL ({"text": ...})."""
    prompts: list[str] = []
    for number, record in read_jsonl(path, ConfigError):
        text = record.get("text") if isinstance(record, dict) else None
        if text is None and isinstance(record, dict) and record.get("turns"):
            text = record["turns"][0]
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{path}:{number}: expected a 'text' or 'turns' field with a non-empty string")
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"dataset {path} has no prompts")
    return prompts[:limit] if limit else prompts


@dataclass
class MethodRun:
    outputs: list[list[int]] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    ttft: list[float] = field(default_factory=list)

    def summary(self, ar: "MethodRun | None") -> dict:
        tps = self.output_tokens / self.seconds if self.seconds else 0.0
        equal = [a == b for a, b in zip(self.outputs, ar.outputs)] if ar else []
        return {
            "tokens_per_s": round(tps, 3),
            "acceptance_length": round(self.output_tokens / self.target_forwards, 4) if self.target_forwards else None,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "speedup_vs_ar": round(tps / (ar.output_tokens / ar.seconds), 4) if ar and ar.seconds else None,
            "outputs_equal_ar": all(equal) if equal else None,
            "outputs_equal_ar_fraction": round(sum(equal) / len(equal), 4) if equal else None,
            "total_output_tokens": self.output_tokens,
            "total_time_s": round(self.seconds, 3),
            "mean_ttft_s": round(sum(self.ttft) / len(self.ttft), 4) if self.ttft else None,
        }


def run_engine_method(engine, prompts: list[str], max_tokens: int, name: str) -> MethodRun:
    params = SamplingParams(max_tokens=max_tokens)
    engine.generate(prompts[0], SamplingParams(max_tokens=8))  # warm-up, not counted
    run = MethodRun()
    for prompt in tqdm(prompts, desc=name, leave=False):
        result = engine.generate(prompt, params)
        m = result.metrics
        run.outputs.append(result.token_ids)
        run.output_tokens += m.output_tokens
        run.seconds += m.total_time_s
        run.target_forwards += m.target_forwards
        run.drafted += m.total_draft_tokens
        run.accepted += m.total_accepted_draft_tokens
        run.ttft.append(m.time_to_first_token_s)
    return run


def run_hf_method(target: LoadedModel, prompts: list[str], max_tokens: int, name: str,
                  prompt_lookup: int) -> MethodRun:
    """transformers' generate() on the same checkpoint and dtype (hf-pld: its prompt lookup decoding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=target.model.dtype).eval()
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if name == "hf-pld" else {}
    tokenizer = target.tokenizer

    def generate(prompt: str, new_tokens: int) -> tuple[list[int], float]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=sorted(target.eos_token_ids),
                                 pad_token_id=tokenizer.pad_token_id or 0, **extra)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start

    generate(prompts[0], 8)
    run = MethodRun()
    for prompt in tqdm(prompts, desc=name, leave=False):
        tokens, seconds = generate(prompt, max_tokens)
        run.outputs.append(tokens)
        run.output_tokens += len(tokens)
        run.seconds += seconds
    return run


def format_table(results: dict[str, dict]) -> str:
    header = f"{'method':<14}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'accept':>8}{'= ar':>7}"
    lines = [header, "-" * len(header)]
    def cell(value, width: int, spec: str = ".2f") -> str:
        return f"{format(value, spec) if value is not None else '-':>{width}}"

    for name, r in results.items():
        equal = r["outputs_equal_ar_fraction"]
        lines.append(f"{name:<14}{cell(r['tokens_per_s'], 9)}{cell(r['speedup_vs_ar'], 9)}"
                     f"{cell(r['acceptance_length'], 7)}{cell(r['acceptance_rate'], 8)}{cell(equal, 7, '.0%')}")
    return "\n".join(lines)


def run_bench(base: DeploymentConfig, target: LoadedModel, prompts: list[str], methods: list[str],
              max_tokens: int, heads: dict[str, str] | None = None) -> dict:
    """`heads`: method -> its head directory (or draft model), else that of the method without '+ngram', else
    `base.speculative_model`."""
    runs: dict[str, MethodRun] = {}
    heads = heads or {}
    for name in methods:
        if name in HF_METHODS:
            runs[name] = run_hf_method(target, prompts, max_tokens, name, base.max_draft_len)
            continue
        method, lookup = method_variant(name)
        model = heads.get(name, heads.get(method, base.speculative_model))
        config = DeploymentConfig(**{**base.__dict__, "method": method, "prompt_lookup_branch": lookup,
                                     "speculative_model": model})
        engine = build_engine(config, target)
        runs[name] = run_engine_method(engine, prompts, max_tokens, name)
    ar = runs.get("ar")
    return {name: run.summary(ar if name != "ar" else None) | ({"speedup_vs_ar": 1.0} if name == "ar" else {})
            for name, run in runs.items()}


TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def tree_step_costs(base: DeploymentConfig, target: LoadedModel, method: str, head: str, prompt: str,
                    tokens: int = 48) -> dict:
    """Milliseconds per decoding step (drafting + tree verification + commit) with trees of 1..64 draft nodes
    (fixed size, no budget), next to one plain step, on one prompt: the price of a tree on this machine."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def per_step(config: DeploymentConfig) -> float:
        engine = build_engine(config, target)
        engine.generate(prompt, SamplingParams(max_tokens=4))
        m = engine.generate(prompt, params).metrics
        return round(1e3 * (m.total_time_s - m.time_to_first_token_s) / max(m.target_forwards - 1, 1), 2)

    costs = {"plain": per_step(DeploymentConfig(**{**base.__dict__, "method": "ar"}))}
    for size in TREE_SIZES:
        config = DeploymentConfig(**{**base.__dict__, "method": method, "speculative_model": head,
                                     "adaptive_draft_len": False, "total_tokens": size,
                                     "top_k": min(size, 8), "max_draft_len": max(1, min(6, size))})
        costs[size] = per_step(config)
    return costs
