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
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specserve.checks import ConfigError, int_at_least, resolve_path
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


class StrictSection(BaseModel):
    """A config file's section: unknown keys, wrong types (a string for a number or a flag) and out-of-range
    values are refused, the error naming the key."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TritonSection(StrictSection):
    max_batch_size: int = Field(ServingConfig.max_batch_size, ge=0)
    decoupled: bool = False


class SpeculativeSection(StrictSection):
    """speculative_config: the keys every method shares; the method's own keys (`extra`) its options class reads."""

    model_config = ConfigDict(extra="allow", strict=True)

    decoding_type: str
    max_draft_len: Optional[int] = Field(None, ge=1)
    depth: Optional[int] = Field(None, ge=1)  # EAGLE's spelling: the levels after the first
    num_eagle_layers: Optional[int] = Field(None, ge=1)
    speculative_model: Optional[str] = None
    speculative_model_dir: Optional[str] = None
    adaptive_draft_len: bool = True

    @model_validator(mode="after")
    def _known_method_keys(self) -> SpeculativeSection:
        known = registry.setting_keys()
        unknown = sorted(key for key in self.model_extra or {} if key not in known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; the methods read: {', '.join(sorted(known))}")
        given = [key for key in DRAFT_LEN_KEYS if getattr(self, key) is not None]
        if len(given) > 1:
            raise ValueError(f"the draft length is given twice ({' and '.join(given)}): keep one")
        return self

    @property
    def draft_len(self) -> int | None:
        for key, extra in DRAFT_LEN_KEYS.items():
            if getattr(self, key) is not None:
                return getattr(self, key) + extra
        return None


class ModelYaml(StrictSection):
    """The TRT-LLM LLM API's model.yaml, as far as it applies here."""

    model: str
    backend: Optional[str] = None
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: Literal[1] = 1  # tensor_parallel_size shards the model
    speculative_config: Optional[SpeculativeSection] = None
    triton_config: TritonSection = TritonSection()
    dtype: Optional[str] = None
    max_model_len: Optional[int] = Field(None, ge=2)
    quantization: Optional[str] = None


# spellings of the draft length, each with what to add: EAGLE's `depth` counts the levels after the first
DRAFT_LEN_KEYS = {"max_draft_len": 0, "depth": 1, "num_eagle_layers": 0}


def first_error(exc: ValidationError, where: str) -> ConfigError:
    """A pydantic error as a ConfigError naming the key (dotted through sections) and what is wrong with it."""
    error = exc.errors()[0]
    key = ".".join(str(part) for part in error["loc"])
    message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
    value = f" (got {error['input']!r})" if error["type"] not in ("extra_forbidden", "missing") and \
        not isinstance(error.get("input"), dict) else ""
    return ConfigError(f"{where}: {key + ': ' if key else ''}{message}{value}")


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
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping with a 'model' key")
    try:
        given = ModelYaml(**data)
    except ValidationError as exc:
        raise first_error(exc, str(path)) from None
    base = Path(path).parent
    model = ModelConfig(resolve_path(given.model, base), given.dtype, given.quantization, given.max_model_len,
                        given.tensor_parallel_size)
    serving = ServingConfig(given.triton_config.max_batch_size, given.triton_config.decoupled)
    spec = given.speculative_config
    return DeploymentConfig(model, serving, read_speculative_config(spec, base) if spec else SpeculativeConfig())


def read_speculative_config(spec: SpeculativeSection, base: Path) -> SpeculativeConfig:
    # the EAGLE spellings of the depth stay the method's settings too: a method without trees refuses them
    settings = {**(spec.model_extra or {}), **{key: getattr(spec, key) for key in ("depth", "num_eagle_layers")
                                                if getattr(spec, key) is not None}}
    entry = registry.resolve(spec.decoding_type)
    if entry is not None and entry.variant is not None:
        entry = entry.variant(settings)
    draft = spec.speculative_model or spec.speculative_model_dir
    config = SpeculativeConfig(entry.name if entry else registry.PLAIN, spec.draft_len,
                               resolve_path(draft, base) if draft else None, spec.adaptive_draft_len, settings)
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
