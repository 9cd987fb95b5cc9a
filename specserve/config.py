"""Deployment configuration: one typed `DeploymentConfig` (model, serving, speculative), the seeds' `model.yaml`
reader (TRT-LLM LLM-API schema) and building an engine from it.

    model: gemma-3-270m            # a name, a checkpoint directory or a .gguf file
    tensor_parallel_size: 2        # optional: the model sharded over 2 ranks (docs/tensor-parallel.md)
    speculative_config:            # absent: the base model, plain decoding
      decoding_type: NGram         # a method as TRT-LLM, vLLM or SGLang spell it (speculative.registry)
      max_draft_len: 4             # trees: the depth limit
      speculative_model: ./draft   # the draft model or the head's directory
    triton_config:
      max_batch_size: 8
      decoupled: false

Every other `speculative_config` key belongs to a method: its options class (`speculative/*.py`) reads and checks
it. The vLLM `model.json` reader is `config_vllm.py`; both only translate their spellings into DeploymentConfig.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from specserve.checks import ConfigError, check_keys, flag, int_at_least, resolve_path
from specserve.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from specserve.speculative import registry
from specserve.speculative.base import DEFAULT_DRAFT_LEN, MethodEntry, MethodOptions

__all__ = ["ConfigError", "DeploymentConfig", "ModelConfig", "ServingConfig", "SpeculativeConfig", "build_engine",
           "load_model_yaml", "resolve_tensor_parallel_size"]


@dataclass
class ModelConfig:
    source: str = DEFAULT_MODEL  # a name, a checkpoint directory or a .gguf file
    dtype: str | None = None
    quantization: str | None = None  # none | gguf | int8 | int4; unset: a GGUF's own blocks, else none
    max_model_len: int | None = None
    tensor_parallel_size: int = 1  # ranks the model is sharded over (specserve/parallel)

    def load(self) -> LoadedModel:
        if self.tensor_parallel_size > 1:
            from specserve.parallel.launch import load_tensor_parallel

            return load_tensor_parallel(self.source, self.dtype, self.quantization, self.tensor_parallel_size)
        return load_model(self.source, dtype=self.dtype, quantization=self.quantization)


@dataclass
class ServingConfig:
    max_batch_size: int = 8  # requests decoded together (0: the runner's default)
    decoupled: bool = False  # Triton: responses may stream


@dataclass
class SpeculativeConfig:
    method: str = registry.PLAIN  # a registry name (`ar`: plain decoding)
    max_draft_len: int | None = None  # draft tokens per step (trees: the depth limit); None: the method's default
    model: str | None = None  # the draft model or the head's directory
    # each step drafts the length (<= max_draft_len) with the most expected tokens/s from measured step costs and
    # acceptance; false drafts max_draft_len every step, as TRT-LLM and vLLM do
    adaptive_draft_len: bool = True
    settings: dict = field(default_factory=dict)  # the method's own speculative_config keys, as given

    @property
    def entry(self) -> MethodEntry | None:
        return None if self.method == registry.PLAIN else registry.BY_NAME[self.method]

    @property
    def options(self) -> MethodOptions | None:
        """The method's typed options (ConfigError naming a bad key)."""
        return None if self.entry is None else self.entry.parse(self)

    @property
    def draft_len(self) -> int:
        """max_draft_len as given, else the method's default for its draft-length policy."""
        if self.max_draft_len is not None:
            return self.max_draft_len
        if self.entry is None:
            return DEFAULT_DRAFT_LEN
        return self.entry.default_draft_len(self.adaptive_draft_len, self.settings)

    @property
    def label(self) -> str:
        """The method as the command line names it (`eagle3+ngram` for an EAGLE tree with the lookup branch)."""
        return registry.PLAIN if self.entry is None else self.options.label

    def with_method(self, text: str) -> SpeculativeConfig:
        """The same settings under another command-line method ('eagle3+ngram' turns on its lookup branch)."""
        entry, implied = registry.parse_method(text)
        return replace(self, method=entry.name if entry else registry.PLAIN, settings={**self.settings, **implied})

    def check(self) -> None:
        """ConfigError for a bad draft length or a bad value of a key the method reads."""
        int_at_least(self.draft_len, "max_draft_len")
        if self.entry is not None:
            self.entry.parse(self)


@dataclass
class DeploymentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


TOP_LEVEL_KEYS = {"model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "speculative_config",
                  "triton_config", "dtype", "max_model_len", "quantization"}
COMMON_SPEC_KEYS = {"decoding_type", "max_draft_len", "speculative_model", "speculative_model_dir",
                    "adaptive_draft_len"}
# spellings of the draft length, each with what to add: EAGLE's `depth` counts the levels after the first
DRAFT_LEN_KEYS = {"max_draft_len": 0, "depth": 1, "num_eagle_layers": 0}
TRITON_KEYS = {"max_batch_size", "decoupled"}


def resolve_tensor_parallel_size(given: int | None, configured: int = 1) -> int:
    """The command line's tensor parallel size, else the config's, else (under torchrun) its WORLD_SIZE."""
    if given is not None:
        return int_at_least(given, "--tensor-parallel-size")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return configured if configured > 1 or world <= 1 else world


def load_model_yaml(path: Path) -> DeploymentConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError(f"{path} must be a mapping with a 'model' key")
    check_keys(data, TOP_LEVEL_KEYS, str(path))
    if data.get("pipeline_parallel_size", 1) != 1:
        raise ConfigError(f"pipeline_parallel_size={data['pipeline_parallel_size']!r} is not supported: use "
                          "tensor_parallel_size")
    base = Path(path).parent
    max_model_len = data.get("max_model_len")
    model = ModelConfig(resolve_path(str(data["model"]), base), data.get("dtype"), data.get("quantization"),
                        None if max_model_len is None else int_at_least(max_model_len, "max_model_len", 2),
                        int_at_least(data.get("tensor_parallel_size", 1), "tensor_parallel_size"))
    triton = data.get("triton_config") or {}
    check_keys(triton, TRITON_KEYS, "triton_config")
    serving = ServingConfig(int_at_least(triton.get("max_batch_size", ServingConfig.max_batch_size),
                                         "max_batch_size", 0),
                            flag(triton.get("decoupled", False), "triton_config.decoupled"))
    spec = data.get("speculative_config")
    return DeploymentConfig(model, serving, read_speculative_config(spec, base) if spec else SpeculativeConfig())


def read_speculative_config(spec: dict, base: Path) -> SpeculativeConfig:
    check_keys(spec, COMMON_SPEC_KEYS | set(DRAFT_LEN_KEYS) | registry.setting_keys(), "speculative_config")
    if "decoding_type" not in spec:
        raise ConfigError("speculative_config needs decoding_type")
    settings = {k: v for k, v in spec.items() if k not in COMMON_SPEC_KEYS}
    entry = registry.resolve(spec["decoding_type"])
    if entry is not None and entry.variant is not None:
        entry = entry.variant(settings)
    draft = spec.get("speculative_model") or spec.get("speculative_model_dir")
    config = SpeculativeConfig(entry.name if entry else registry.PLAIN,
                               model=resolve_path(str(draft), base) if draft else None,
                               adaptive_draft_len=flag(spec.get("adaptive_draft_len", True), "adaptive_draft_len"),
                               settings=settings)
    given = [key for key in DRAFT_LEN_KEYS if key in spec]
    if len(given) > 1:
        raise ConfigError(f"speculative_config gives the draft length twice ({' and '.join(given)}): keep one")
    for key in given:
        config.max_draft_len = int_at_least(spec[key], key) + DRAFT_LEN_KEYS[key]
    registry.check_exclusive(entry, settings)
    config.check()
    return config


def with_method_settings(config: DeploymentConfig, settings: dict) -> DeploymentConfig:
    """The config with those of `settings` its method reads (operator flags such as --suffix-cache-scope, which
    mean nothing to other methods) put over its own."""
    entry = config.speculative.entry
    own = {key: value for key, value in settings.items() if entry is not None and key in entry.options.KEYS}
    if not own:
        return config
    spec = replace(config.speculative, settings={**config.speculative.settings, **own})
    spec.check()
    return replace(config, speculative=spec)


def build_method(config: SpeculativeConfig, target: LoadedModel):
    """The SpecMethod for a config (None for plain decoding)."""
    return None if config.entry is None else config.entry.create(config, target)


def build_engine(config: DeploymentConfig, target: LoadedModel | None = None):
    from specserve.engine.engine import Engine

    target = target or config.model.load()
    method = build_method(config.speculative, target)
    return Engine(target, method, config.speculative.draft_len if method else 0, config.model.max_model_len,
                  config.speculative.adaptive_draft_len)
