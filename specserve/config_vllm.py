"""The vLLM backend's `model.json` (AsyncEngineArgs: the flat pre-0.8 keys or `speculative_config`) read into a
DeploymentConfig. Unknown keys are an error naming the key; keys that only tune vLLM's GPU engine are accepted."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.checks import ConfigError, check_keys, int_at_least, resolve_path
from specserve.config import DeploymentConfig, ModelConfig, ServingConfig, SpeculativeConfig
from specserve.speculative import registry

# vLLM AsyncEngineArgs keys that change nothing here (GPU memory, logging, scheduling knobs)
VLLM_HARMLESS_KEYS = {
    "gpu_memory_utilization", "disable_log_requests", "enable_log_requests", "disable_log_stats", "enforce_eager",
    "trust_remote_code", "max_num_seqs", "max_num_batched_tokens", "swap_space", "block_size",
    "enable_prefix_caching", "enable_chunked_prefill", "seed", "tokenizer_mode", "revision", "tokenizer_revision",
    "download_dir", "load_format", "distributed_executor_backend", "disable_custom_all_reduce", "max_logprobs",
    "max_seq_len_to_capture", "cpu_offload_gb", "served_model_name", "preemption_mode", "num_scheduler_steps",
    "compilation_config", "worker_use_ray", "engine_use_ray", "use_v2_block_manager", "kv_cache_dtype",
    "disable_sliding_window", "skip_tokenizer_init", "device", "max_parallel_loading_workers",
    "speculative_draft_tensor_parallel_size", "speculative_disable_by_batch_size", "speculative_max_model_len",
    "speculative_disable_mqa_scorer", "spec_decoding_acceptance_method", "tokenizer",
}
VLLM_FLAT_SPEC_KEYS = ("speculative_model", "num_speculative_tokens", "ngram_prompt_lookup_max",
                       "ngram_prompt_lookup_min")
VLLM_KEYS = VLLM_HARMLESS_KEYS | set(VLLM_FLAT_SPEC_KEYS) | {
    "model", "dtype", "quantization", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
    "speculative_config",
}
VLLM_SPEC_KEYS = registry.vllm_setting_keys() | {
    "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_tensor_parallel_size",
    "disable_by_batch_size", "max_model_len", "acceptance_method", "disable_mqa_scorer", "disable_padded_drafter_batch"}


def load_model_json(path: Path) -> DeploymentConfig:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError(f"{path} must be a JSON object with a 'model' key")
    check_keys(data, VLLM_KEYS, str(path))
    for key in ("pipeline_parallel_size", "speculative_draft_tensor_parallel_size"):
        if data.get(key, 1) != 1:
            raise ConfigError(f"{key}={data[key]!r} is not supported: the drafter runs on rank 0, and only "
                              "tensor_parallel_size shards the model")
    dtype = data.get("dtype")
    model = ModelConfig(resolve_path(str(data["model"]), Path(path).parent),
                        None if dtype in (None, "auto") else str(dtype), data.get("quantization"),
                        data.get("max_model_len"),
                        int_at_least(data.get("tensor_parallel_size", 1), "tensor_parallel_size"))
    if model.max_model_len is not None:
        int_at_least(model.max_model_len, "max_model_len", 2)
    # the vLLM backend's auto-complete makes every model decoupled, with no batching of its own
    return DeploymentConfig(model, ServingConfig(max_batch_size=0, decoupled=True), read_speculative(data, path))


def read_speculative(data: dict, path: Path) -> SpeculativeConfig:
    spec = data.get("speculative_config")
    if spec is not None:
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative_config in {path} must be an object")
        flat = next((key for key in VLLM_FLAT_SPEC_KEYS if key in data), None)
        if flat:
            raise ConfigError(f"{path}: give either speculative_config or the flat key {flat!r}, not both")
        check_keys(spec, VLLM_SPEC_KEYS, "speculative_config")
        if spec.get("draft_tensor_parallel_size", 1) != 1:
            raise ConfigError("draft_tensor_parallel_size must be 1: specserve runs on one device")
        draft, method = spec.get("model"), spec.get("method")
        tokens_key = "speculative_config.num_speculative_tokens"
        lookup = {"prompt_lookup_max": spec.get("prompt_lookup_max"), "prompt_lookup_min": spec.get("prompt_lookup_min")}
    else:
        draft, method = data.get("speculative_model"), None
        tokens_key = "num_speculative_tokens"
        lookup = {"prompt_lookup_max": data.get("ngram_prompt_lookup_max"),
                  "prompt_lookup_min": data.get("ngram_prompt_lookup_min")}
    entry = vllm_method(method, draft, "speculative_config" if spec is not None else str(path))
    if entry is None:
        return SpeculativeConfig()
    settings = {k: int_at_least(v, k, 1) for k, v in lookup.items() if v is not None}
    own = {k: v for k, v in (spec or {}).items() if k in entry.vllm_keys}
    registry.check_exclusive(entry, {k: v for k, v in (spec or {}).items() if k in registry.vllm_setting_keys()})
    tokens = data.get(tokens_key) if spec is None else spec.get("num_speculative_tokens")
    if tokens is None and entry.vllm_default_draft_len is not None:
        tokens = entry.vllm_default_draft_len(own)
    if tokens is None:
        raise ConfigError(f"{path}: {tokens_key} is required with speculative decoding")
    config = SpeculativeConfig(entry.name, int_at_least(tokens, tokens_key, 1), settings={**settings, **own})
    config.check()
    if entry.model_needed:
        if not draft:
            raise ConfigError(f"{path}: the {entry.name} method needs the draft model's or head's path ('model')")
        config.model = resolve_path(str(draft), Path(path).parent)
        # older vLLM names an EAGLE head as the draft model: use it as one
        config.method = registry.method_for_model(config.model, entry).name
    return config


def vllm_method(method: str | None, draft: str | None, where: str):
    """The entry for a vLLM method, or for the flat form's `speculative_model` (a method spelling such as
    '[ngram]', else a draft model); None: no speculation."""
    if method is not None:
        return registry.resolve_vllm(method, where)
    if draft is None:
        return None
    return registry.BY_VLLM_SPELLING.get(draft.strip().lower()) or registry.method_for_model(draft)
