"""Offline benchmark: every method, plain decoding and HF transformers on the same prompts, in one run.

Concurrency 1, greedy. Each method first runs the first prompt in full, untimed (one-time costs such as kernel
compilation, cost tables and caches land there and are reported apart as `warmup_s`), then every prompt once, the
methods taking turns prompt by prompt (every method answers a prompt before the next prompt starts), so a drift in
the machine's speed during the run moves every method alike; tokens/s is total output tokens over total wall time,
so ratios between methods are side by side on the same machine, prompts and token ids. `llamacpp` /
`llamacpp-pld` (llama.cpp's plain and prompt-lookup decoding of the same GGUF, through llama-cpp-python when it is
installed) and `llamacpp-native` (llama.cpp's own llama-server built natively: native_llamacpp.py) take the very token
ids specserve's tokenizer makes. llama-cpp-python's per-token Python loop slows llama.cpp down: compare against
`llamacpp-native`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench.jsonl import read_jsonl
from specserve.bench.method_run import MethodRun
from specserve.config import ConfigError, DeploymentConfig, build_engine
from specserve.models.huge_pages import huge_page_buffer
from specserve.models.loader import LoadedModel
from specserve.speculative.registry import PLAIN
from specserve.speculative.sampling import SamplingParams

HF_METHODS = ("hf", "hf-pld")
LLAMACPP_METHODS = ("llamacpp", "llamacpp-pld")
NATIVE_METHOD = "llamacpp-native"
PEER_METHODS = HF_METHODS + LLAMACPP_METHODS + (NATIVE_METHOD,)


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


def warm_up(generate: Callable, prompt: str, max_tokens: int) -> float:
    """One untimed request of full length; returns its seconds (the one-time costs), reported apart."""
    start = time.perf_counter()
    generate(prompt, max_tokens)
    return time.perf_counter() - start


class TimedRunner:
    """A peer's generate(prompt, new_tokens) -> (token ids, seconds), one prompt per `step` after its warm-up."""

    def __init__(self, generate: Callable[[str, int], tuple[list[int], float]], first_prompt: str, max_tokens: int):
        self.generate, self.max_tokens = generate, max_tokens
        self.run = MethodRun(warmup_s=warm_up(generate, first_prompt, max_tokens))

    def step(self, prompt: str) -> None:
        tokens, seconds = self.generate(prompt, self.max_tokens)
        self.run.outputs.append(tokens)
        self.run.output_tokens += len(tokens)
        self.run.seconds += seconds

    def finish(self) -> MethodRun:
        return self.run


class EngineRunner:
    """One engine's requests, one prompt per `step`, in the order given, so a method that learns across requests
    (suffix) drafts each from the ones before it, and the draft-length choice starts each from the acceptance of
    those before it; what both learnt from the warm-up is forgotten first (the warm-up's prompt is the first timed
    one)."""

    def __init__(self, engine, first_prompt: str, max_tokens: int):
        self.engine, self.params = engine, SamplingParams(max_tokens=max_tokens)
        self.run = MethodRun(warmup_s=warm_up(lambda p, n: engine.generate(p, SamplingParams(max_tokens=n)),
                                              first_prompt, max_tokens))
        engine.forget_requests()

    def step(self, prompt: str) -> None:
        result = self.engine.generate(prompt, self.params)
        m, run = result.metrics, self.run
        run.outputs.append(result.token_ids)
        run.output_tokens += m.output_tokens
        run.seconds += m.total_time_s
        run.target_forwards += m.target_forwards
        run.drafted += m.total_draft_tokens
        run.accepted += m.total_accepted_draft_tokens
        run.draft_seconds += m.draft_time_s
        run.ttft.append(m.time_to_first_token_s)

    def finish(self) -> MethodRun:
        self.run.method_state = self.engine.method.stats() if self.engine.method is not None else {}
        return self.run


def run_engine_method(engine, prompts: list[str], max_tokens: int, name: str) -> MethodRun:
    """The prompts in order through one engine alone (EngineRunner)."""
    runner = EngineRunner(engine, prompts[0], max_tokens)
    for prompt in tqdm(prompts, desc=name, leave=False):
        runner.step(prompt)
    return runner.finish()


def hf_runner(target: LoadedModel, first_prompt: str, max_tokens: int, name: str,
              prompt_lookup: int) -> TimedRunner:
    """transformers' generate() on the same checkpoint and dtype (hf-pld: its prompt lookup decoding)."""
    from transformers import AutoModelForCausalLM

    if target.gguf is not None:  # transformers dequantizes the GGUF itself
        model = AutoModelForCausalLM.from_pretrained(str(target.gguf.parent), gguf_file=target.gguf.name,
                                                     dtype=target.model.dtype).eval()
    else:
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

    return TimedRunner(generate, first_prompt, max_tokens)


def llamacpp_runner(target: LoadedModel, first_prompt: str, max_tokens: int, name: str,
                    prompt_lookup: int) -> TimedRunner:
    """llama.cpp through llama-cpp-python (a Python loop per token) on the same GGUF file and the same prompt token
    ids, greedy, all cores; llamacpp-pld adds its prompt-lookup draft of `prompt_lookup` tokens. The output ids end
    with the stop token, as specserve's do."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise ConfigError(f"{name} needs llama-cpp-python: pip install 'specserve[llamacpp]'") from None
    if target.gguf is None:
        raise ConfigError(f"{name} runs GGUF models only, and {target.name} is not one")
    draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if name == "llamacpp-pld" else None
    llm = llama_cpp.Llama(model_path=str(target.gguf), n_ctx=4096, n_threads=os.cpu_count(), draft_model=draft,
                          verbose=False)

    def generate(prompt: str, new_tokens: int) -> tuple[list[int], float]:
        ids = target.tokenizer(prompt).input_ids
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if token in target.eos_token_ids or len(tokens) >= new_tokens:
                break
        return tokens, time.perf_counter() - start

    return TimedRunner(generate, first_prompt, max_tokens)


def format_table(results: dict[str, dict]) -> str:
    header = (f"{'method':<14}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'accept':>8}{'= ar':>7}{'step ms':>9}"
              f"{'draft ms':>10}")
    lines = [header, "-" * len(header)]
    def cell(value, width: int, spec: str = ".2f") -> str:
        return f"{format(value, spec) if value is not None else '-':>{width}}"

    for name, r in results.items():
        equal = r["outputs_equal_ar_fraction"]
        lines.append(f"{name:<14}{cell(r['tokens_per_s'], 9)}{cell(r['speedup_vs_ar'], 9)}"
                     f"{cell(r['acceptance_length'], 7)}{cell(r['acceptance_rate'], 8)}{cell(equal, 7, '.0%')}"
                     f"{cell(r.get('step_ms'), 9)}{cell(r.get('draft_ms_per_step'), 10)}")
    return "\n".join(lines)


def run_bench(base: DeploymentConfig, target: LoadedModel, prompts: list[str], methods: list[str],
              max_tokens: int, heads: dict[str, str] | None = None) -> dict:
    """`heads`: method -> its head directory (or draft model), else that of the method without its '+' suffix,
    else `base.speculative.model`."""
    runners: dict[str, TimedRunner | EngineRunner] = {}
    heads = heads or {}
    for name in methods:
        draft_len = base.speculative.draft_len
        if name in HF_METHODS:
            runners[name] = hf_runner(target, prompts[0], max_tokens, name, draft_len)
        elif name == NATIVE_METHOD:
            from specserve.bench.native_llamacpp import native_runner

            runners[name] = native_runner(target, prompts[0], max_tokens)
        elif name in LLAMACPP_METHODS:
            runners[name] = llamacpp_runner(target, prompts[0], max_tokens, name, draft_len)
        else:
            spec = base.speculative.with_method(name)
            spec.model = heads.get(name, heads.get(spec.method, base.speculative.model))
            engine = build_engine(replace(base, speculative=spec), target)
            runners[name] = EngineRunner(engine, prompts[0], max_tokens)
    for prompt in tqdm(prompts, desc=",".join(methods), leave=False):
        for runner in runners.values():
            runner.step(prompt)
    runs = {name: runner.finish() for name, runner in runners.items()}
    ar = runs.get(PLAIN)
    return {name: run.summary(ar if name != PLAIN else None) | ({"speedup_vs_ar": 1.0} if name == PLAIN else {})
            for name, run in runs.items()}


def streamed_weight_bytes(model) -> int:
    """Bytes of weights one decoding step reads: every layer, the final norm and the lm_head (a separate input
    embedding only gives a few rows, so it is left out)."""
    from specserve.models.quant import QuantEmbedding, QuantLinear

    tensors = []
    for name, module in model.named_modules():
        if name == "model.embed_tokens" and not model.spec.tie_word_embeddings:
            continue
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            tensors += [t for t in module.packed.tensors if t is not None]
        tensors += list(module.parameters(recurse=False))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}  # fused parts
    return sum(storages.values())  # are views of their fused weight: each storage counts once


def multiply_adds_per_token(spec) -> int:
    """The weight multiply-adds of one token's forward: every layer's projections and the lm_head (attention over
    the context is left out: at the short contexts `--step-costs` times, it is a few percent)."""
    attention = spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)  # q, o, k, v
    return spec.num_layers * (attention + 3 * spec.hidden_size * spec.intermediate_size) \
        + spec.vocab_size * spec.hidden_size


def compute_rates(model, costs_ms: dict[int, float]) -> dict:
    """Each timed forward's achieved multiply-adds per second next to the CPU's int8 peak (a probe of the running
    kernel path's multiply instruction on all threads)."""
    from specserve.models.quant import int8_peak_macs, quant_path

    per_token = multiply_adds_per_token(model.spec)
    peak = int8_peak_macs()
    achieved = {n: per_token * n / (ms / 1e3) for n, ms in costs_ms.items()}
    return {"multiply_adds_per_token": per_token, "int8_peak_gmacs": round(peak / 1e9, 1), "isa": quant_path(),
            "gmacs_by_tokens": {n: round(v / 1e9, 1) for n, v in achieved.items()},
            "share_of_peak_by_tokens": {n: round(v / peak, 3) for n, v in achieved.items()} if peak else {}}


def memory_read_seconds(buffer: torch.Tensor, repeats: int = 2) -> float:
    """The best of a few streaming reads of `buffer` on all threads (the quantized kernel's probe)."""
    from specserve.models.quant import stream_read

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        stream_read(buffer)
        best = min(best, time.perf_counter() - start)
    return best


def roofline(model, rounds: int = 7, megabytes: int = 512) -> dict:
    """A plain step next to the time to read its weights once at the measured read bandwidth. The two are timed
    in pairs, one right after the other, and the median pair's ratio is reported: a VM's bandwidth drifts between
    minutes, so a step and a probe timed apart can disagree by half for the same step."""
    from specserve.models.step_costs import StepCosts

    weight_bytes = streamed_weight_bytes(model)
    # far larger than the caches, in pages of the size the packed weights have
    buffer = huge_page_buffer(megabytes * 2**20).fill_(1)
    memory_read_seconds(buffer, repeats=1)  # first touch: page faults, not reads
    pairs = []
    plain_step = StepCosts.forward_run(model, 1, 1)
    for _ in range(rounds):
        step = StepCosts.least_disturbed([plain_step])[0]
        gbs = buffer.numel() / memory_read_seconds(buffer) / 1e9
        pairs.append((step * 1e3 / (weight_bytes / gbs / 1e6), step * 1e3, gbs))
    ratio, step_ms, bandwidth = sorted(pairs)[len(pairs) // 2]
    floor_ms = weight_bytes / bandwidth / 1e6
    return {"weights_mb": round(weight_bytes / 1e6, 1), "read_gb_per_s": round(bandwidth, 2),
            "roofline_ms": round(floor_ms, 4), "plain_step_ms": round(step_ms, 3),
            "step_over_roofline": round(ratio, 3), "rounds": rounds,
            "ratio_range": [round(min(pairs)[0], 3), round(max(pairs)[0], 3)]}


TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
TREE_DEPTHS = (1, 3, 6)  # levels drafted, one head forward each
TREE_WIDTH = 8  # top_k: the most nodes one level adds below a node


def tree_step_costs(base: DeploymentConfig, target: LoadedModel, method: str, head: str, prompt: str,
                    tokens: int = 48) -> dict:
    """Milliseconds per decoding step (drafting + tree verification + commit) with trees of 1..64 draft nodes
    (fixed size, no budget) drafted 1, 3 and 6 levels deep (never more levels than nodes; one level holds at most
    TREE_WIDTH), next to one plain step, on one prompt: the price of a tree on this machine, with its drafting's
    depth apart: {"plain": ms, "levels": {depth: {nodes: ms}}}."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def per_step(config: DeploymentConfig) -> float:
        engine = build_engine(config, target)
        engine.generate(prompt, SamplingParams(max_tokens=4))
        m = engine.generate(prompt, params).metrics
        return round(1e3 * (m.total_time_s - m.time_to_first_token_s) / max(m.target_forwards - 1, 1), 2)

    tree = base.speculative.with_method(method)
    measured: dict[tuple[int, int], float] = {}

    def cost(size: int, levels: int) -> float:
        if (size, levels) not in measured:
            spec = replace(tree, model=head, adaptive_draft_len=False, max_draft_len=levels,
                           settings={**tree.settings, "max_total_draft_tokens": size, "top_k": min(size, TREE_WIDTH)})
            measured[size, levels] = per_step(replace(base, speculative=spec))
        return measured[size, levels]

    plain = per_step(replace(base, speculative=base.speculative.with_method(PLAIN)))
    levels = {depth: {size: cost(size, min(depth, size)) for size in TREE_SIZES if size <= TREE_WIDTH ** depth}
              for depth in TREE_DEPTHS}
    return {"plain": plain, "levels": levels}
