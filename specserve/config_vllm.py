"""The vLLM backend's `model.json` (AsyncEngineArgs: the flat pre-0.8 keys or `speculative_config`) read into a
DeploymentConfig. Unknown keys are an error naming the key; keys that only tune vLLM's GPU engine are accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import ConfigDict, Field, ValidationError, model_validator

from specserve.checks import ConfigError, int_at_least, resolve_path
from specserve.config import (DeploymentConfig, ModelConfig, ServingConfig, SpeculativeConfig, StrictSection,
                              first_error)
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
    "speculative_disable_by_batch_size", "speculative_max_model_len",
    "speculative_disable_mqa_scorer", "spec_decoding_acceptance_method", "tokenizer",
}
VLLM_FLAT_SPEC_KEYS = ("speculative_model", "num_speculative_tokens", "ngram_prompt_lookup_max",
                       "ngram_prompt_lookup_min")
VLLM_HARMLESS_SPEC_KEYS = {"disable_by_batch_size", "max_model_len", "acceptance_method", "disable_mqa_scorer",
                           "disable_padded_drafter_batch"}


def _unknown(extra: dict | None, allowed: set[str]) -> None:
    unknown = sorted(key for key in extra or {} if key not in allowed)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}")


class VllmSpeculativeSection(StrictSection):
    """speculative_config: vLLM's common keys; the methods' own and the GPU knobs (`extra`) checked by name."""

    model_config = ConfigDict(extra="allow", strict=True)

    method: Optional[str] = None
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = Field(None, ge=1)
    prompt_lookup_max: Optional[int] = Field(None, ge=1)
    prompt_lookup_min: Optional[int] = Field(None, ge=1)
    draft_tensor_parallel_size: Literal[1] = 1  # the drafter runs on rank 0

    @model_validator(mode="after")
    def _known_keys(self) -> VllmSpeculativeSection:
        _unknown(self.model_extra, registry.vllm_setting_keys() | VLLM_HARMLESS_SPEC_KEYS)
        return self


class ModelJson(StrictSection):
    """The vLLM backend's model.json (AsyncEngineArgs), as far as it applies here; the GPU engine's knobs
    (VLLM_HARMLESS_KEYS) are accepted and change nothing."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    dtype: Optional[str] = None
    quantization: Optional[str] = None
    max_model_len: Optional[int] = Field(None, ge=2)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: Literal[1] = 1  # only tensor_parallel_size shards the model
    speculative_config: Optional[VllmSpeculativeSection] = None
    speculative_model: Optional[str] = None  # the flat (pre-0.8) form of speculative_config
    num_speculative_tokens: Optional[int] = Field(None, ge=1)
    ngram_prompt_lookup_max: Optional[int] = Field(None, ge=1)
    ngram_prompt_lookup_min: Optional[int] = Field(None, ge=1)
    speculative_draft_tensor_parallel_size: Literal[1] = 1

    @model_validator(mode="after")
    def _known_keys(self) -> ModelJson:
        _unknown(self.model_extra, VLLM_HARMLESS_KEYS)
        if self.speculative_config is not None:
            flat = next((key for key in VLLM_FLAT_SPEC_KEYS if getattr(self, key) is not None), None)
            if flat:
                raise ValueError(f"give either speculative_config or the flat key {flat!r}, not both")
        return self


def load_model_json(path: Path) -> DeploymentConfig:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a JSON object with a 'model' key")
    try:
        given = ModelJson(**data)
    except ValidationError as exc:
        raise first_error(exc, str(path)) from None
    model = ModelConfig(resolve_path(given.model, Path(path).parent),
                        None if given.dtype in (None, "auto") else given.dtype, given.quantization,
                        given.max_model_len, given.tensor_parallel_size)
    # the vLLM backend's auto-complete makes every model decoupled, with no batching of its own
    return DeploymentConfig(model, ServingConfig(max_batch_size=0, decoupled=True), read_speculative(given, path))


def read_speculative(given: ModelJson, path: Path) -> SpeculativeConfig:
    spec = given.speculative_config
    if spec is not None:
        draft, method, tokens = spec.model, spec.method, spec.num_speculative_tokens
        tokens_key = "speculative_config.num_speculative_tokens"
        lookup = {"prompt_lookup_max": spec.prompt_lookup_max, "prompt_lookup_min": spec.prompt_lookup_min}
        own_keys = spec.model_extra or {}
    else:
        draft, method, tokens = given.speculative_model, None, given.num_speculative_tokens
        tokens_key = "num_speculative_tokens"
        lookup = {"prompt_lookup_max": given.ngram_prompt_lookup_max,
                  "prompt_lookup_min": given.ngram_prompt_lookup_min}
        own_keys = {}
    entry = vllm_method(method, draft, "speculative_config" if spec is not None else str(path))
    if entry is None:
        return SpeculativeConfig()
    settings = {k: v for k, v in lookup.items() if v is not None}
    own = {k: v for k, v in own_keys.items() if k in entry.vllm_keys}
    registry.check_exclusive(entry, {k: v for k, v in own_keys.items() if k in registry.vllm_setting_keys()})
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
