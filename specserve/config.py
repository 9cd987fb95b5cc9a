"""Deployment configuration in the seeds' `model.yaml` form (TRT-LLM LLM-API schema), and building an engine from it.

    model: gemma-3-270m            # a name, a checkpoint directory or a .gguf file
    speculative_config:            # absent: the base model, plain decoding
      decoding_type: NGram         # NGram | Draft_Target | Medusa | Eagle | Eagle3
      max_draft_len: 4             # Medusa / EAGLE: the tree's depth limit
      speculative_model: ./draft   # Draft_Target: the draft model; Medusa / EAGLE: the head's directory

EAGLE trees: `Eagle` with `eagle_choices` (or none of the dynamic-tree knobs) is EAGLE-1's static tree
(`mc_sim_7b_63` by default); `Eagle` with `use_dynamic_tree: true` or a dynamic-tree knob is EAGLE-2; `Eagle3` is
EAGLE-3 with a dynamic tree. Dynamic-tree knobs, in the EAGLE repository's spelling (`top_k`, `depth` = levels
after the first, `total_token` = nodes including the root) or TensorRT-LLM's (`max_non_leaves_per_layer` or
`dynamic_tree_max_topK`, `num_eagle_layers` = levels, `max_total_draft_tokens`); `eagle3_layers_to_capture`
names EAGLE-3's target layers. `prompt_lookup_branch: true` merges prompt lookup's continuation into every EAGLE
tree (`eagle3+ngram` as a method name on the command line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from specserve.models.loader import DEFAULT_MODEL, LoadedModel, load_model


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key."""


# decoding_type spellings users bring from TRT-LLM, vLLM and SGLang, mapped to specserve's method names
DECODING_TYPES = {
    "ngram": "ngram", "prompt_lookup": "ngram",
    "draft_target": "draft_target", "draft_model": "draft_target", "draft": "draft_target",
    "standalone": "draft_target",
    "medusa": "medusa",
    "eagle": "eagle", "eagle1": "eagle", "eagle2": "eagle2", "eagle3": "eagle3",
}
EAGLE_METHODS = ("eagle", "eagle2", "eagle3")
DYNAMIC_TREE_KEYS = {"top_k", "depth", "total_token", "max_non_leaves_per_layer", "dynamic_tree_max_topK",
                     "num_eagle_layers", "max_total_draft_tokens"}
TOP_LEVEL_KEYS = {"model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "speculative_config",
                  "triton_config", "dtype", "max_model_len", "quantization"}
SPEC_KEYS = {"decoding_type", "max_draft_len", "speculative_model", "speculative_model_dir",
             "prompt_lookup_min", "prompt_lookup_max", "max_matching_ngram_size", "medusa_choices",
             "adaptive_draft_len", "eagle_choices", "use_dynamic_tree", "eagle3_layers_to_capture",
             "eagle3_one_model", "greedy_sampling", "typical_acceptance", "posterior_threshold",
             "posterior_alpha", "prompt_lookup_branch"} | DYNAMIC_TREE_KEYS
TRITON_KEYS = {"max_batch_size", "decoupled"}


@dataclass
class DeploymentConfig:
    model: str = DEFAULT_MODEL
    method: str = "ar"  # ar | ngram | draft_target | medusa | eagle | eagle2 | eagle3
    max_draft_len: int = 4
    speculative_model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    dtype: str | None = None
    quantization: str | None = None  # none | gguf | int8 | int4; unset: a GGUF's own blocks, else none
    max_model_len: int | None = None
    max_batch_size: int = 8
    decoupled: bool = False
    medusa_choices: list[list[int]] | None = None  # None: mc_sim_7b_63
    # serving: each step drafts the length (<= max_draft_len) with the most expected tokens/s from measured step
    # costs and acceptance; false drafts max_draft_len every step, as TRT-LLM and vLLM do
    adaptive_draft_len: bool = True
    eagle_choices: list[list[int]] | None = None  # EAGLE-1 static tree; None: mc_sim_7b_63
    top_k: int = 8  # dynamic trees: children per expanded node and nodes expanded per level
    total_tokens: int = 48  # dynamic trees: draft nodes at most (the budget may choose fewer)
    eagle3_layers: list[int] | None = None  # EAGLE-3's fused target layers; None: the head's config or default
    typical: tuple[float, float] | None = None  # Medusa typical acceptance (posterior_threshold, alpha): lossy
    prompt_lookup_branch: bool = False  # EAGLE: merge prompt lookup's continuation into every tree

    @property
    def method_label(self) -> str:
        """The method as the command line names it (`eagle3+ngram` for an EAGLE tree with the lookup branch)."""
        return method_label(self.method, self.prompt_lookup_branch)


def method_label(method: str, lookup_branch: bool) -> str:
    return f"{method}+ngram" if lookup_branch else method


def method_name(decoding_type: str) -> str:
    key = str(decoding_type).strip().lower().replace("-", "_")
    if key in ("ar", "none", "base"):
        return "ar"
    if key not in DECODING_TYPES:
        raise ConfigError(f"unknown decoding_type {decoding_type!r}; supported: NGram, Draft_Target, Medusa, "
                          "Eagle, Eagle3")
    return DECODING_TYPES[key]


def method_variant(name: str) -> tuple[str, bool]:
    """A command-line method name -> (method, prompt lookup branch): 'eagle3+ngram' -> ('eagle3', True)."""
    base, plus, extra = str(name).partition("+")
    method = method_name(base)
    if plus and (extra.strip().lower() not in ("ngram", "prompt_lookup") or method not in EAGLE_METHODS):
        raise ConfigError(f"unknown method {name!r}: '+ngram' follows eagle, eagle2 or eagle3 (e.g. eagle3+ngram)")
    return method, bool(plus)


def check_keys(section: dict, allowed: set[str], where: str) -> None:
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} in {where}; allowed: {', '.join(sorted(allowed))}")


def int_at_least(value, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def resolve_path(value: str, base: Path) -> str:
    """Relative paths in a model.yaml are relative to the file; names like gemma-3-270m stay names."""
    candidate = base / value
    return str(candidate) if not Path(value).is_absolute() and candidate.exists() else value


def load_model_yaml(path: Path) -> DeploymentConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError(f"{path} must be a mapping with a 'model' key")
    check_keys(data, TOP_LEVEL_KEYS, str(path))
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if data.get(key, 1) != 1:
            raise ConfigError(f"{key}={data[key]!r} is not supported: specserve runs on one device")
    base = Path(path).parent
    config = DeploymentConfig(model=resolve_path(str(data["model"]), base), dtype=data.get("dtype"),
                              max_model_len=data.get("max_model_len"), quantization=data.get("quantization"))
    spec = data.get("speculative_config")
    if spec:
        check_keys(spec, SPEC_KEYS, "speculative_config")
        if "decoding_type" not in spec:
            raise ConfigError("speculative_config needs decoding_type")
        config.method = method_name(spec["decoding_type"])
        config.max_draft_len = int_at_least(spec.get("max_draft_len", config.max_draft_len), "max_draft_len")
        draft = spec.get("speculative_model") or spec.get("speculative_model_dir")
        config.speculative_model = resolve_path(str(draft), base) if draft else None
        config.prompt_lookup_max = int_at_least(
            spec.get("prompt_lookup_max", spec.get("max_matching_ngram_size", config.prompt_lookup_max)),
            "prompt_lookup_max")
        config.prompt_lookup_min = int_at_least(spec.get("prompt_lookup_min", config.prompt_lookup_min),
                                                 "prompt_lookup_min")
        config.medusa_choices = spec.get("medusa_choices")
        read_eagle_knobs(spec, config)
        if spec.get("typical_acceptance"):
            if config.method != "medusa":
                raise ConfigError("typical_acceptance is Medusa's (decoding_type: Medusa)")
            config.typical = (float(spec.get("posterior_threshold", 0.09)), float(spec.get("posterior_alpha", 0.3)))
        config.prompt_lookup_branch = spec.get("prompt_lookup_branch", False)
        if not isinstance(config.prompt_lookup_branch, bool):
            raise ConfigError(f"prompt_lookup_branch must be true or false, got {config.prompt_lookup_branch!r}")
        if config.prompt_lookup_branch and config.method not in EAGLE_METHODS:
            raise ConfigError("prompt_lookup_branch is for EAGLE trees (decoding_type: Eagle or Eagle3)")
        config.adaptive_draft_len = spec.get("adaptive_draft_len", True)
        if not isinstance(config.adaptive_draft_len, bool):
            raise ConfigError(f"adaptive_draft_len must be true or false, got {config.adaptive_draft_len!r}")
    triton = data.get("triton_config") or {}
    check_keys(triton, TRITON_KEYS, "triton_config")
    config.max_batch_size = int_at_least(triton.get("max_batch_size", config.max_batch_size), "max_batch_size", 0)
    config.decoupled = bool(triton.get("decoupled", False))
    return config


def read_eagle_knobs(spec: dict, config: DeploymentConfig) -> None:
    """EAGLE tree settings in the EAGLE repository's or TensorRT-LLM's spelling (see the module docstring)."""
    if config.method == "eagle" and (spec.get("use_dynamic_tree") or DYNAMIC_TREE_KEYS & set(spec)):
        config.method = "eagle2"
    config.eagle_choices = spec.get("eagle_choices")
    for key in ("top_k", "max_non_leaves_per_layer", "dynamic_tree_max_topK"):
        if key in spec:
            config.top_k = int_at_least(spec[key], key)
    if "total_token" in spec:
        config.total_tokens = int_at_least(spec["total_token"], "total_token", 2) - 1
    if "max_total_draft_tokens" in spec:
        config.total_tokens = int_at_least(spec["max_total_draft_tokens"], "max_total_draft_tokens")
    if "depth" in spec:
        config.max_draft_len = int_at_least(spec["depth"], "depth") + 1
    if "num_eagle_layers" in spec:
        config.max_draft_len = int_at_least(spec["num_eagle_layers"], "num_eagle_layers")
    layers = spec.get("eagle3_layers_to_capture")
    if layers is not None:
        if not isinstance(layers, list) or len(layers) != 3:
            raise ConfigError(f"eagle3_layers_to_capture must list 3 target layers, got {layers!r}")
        config.eagle3_layers = [int_at_least(layer, "eagle3_layers_to_capture", 1) for layer in layers]


def build_method(config: DeploymentConfig, target: LoadedModel):
    """The SpecMethod for a config (None for plain decoding)."""
    from specserve.speculative.proposers import DraftModelMethod, NGramMethod
    from specserve.speculative.weights import read_draft_vocab

    if config.method == "ar":
        return None
    if config.method == "ngram":
        try:
            return NGramMethod(config.prompt_lookup_min, config.prompt_lookup_max)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if config.method == "medusa":
        return build_medusa(config, target)
    if config.method in EAGLE_METHODS:
        return build_eagle(config, target)
    if config.method == "draft_target":
        if not config.speculative_model:
            raise ConfigError("Draft_Target needs speculative_model (the draft model's path)")
        draft = load_model(config.speculative_model, dtype=target.model.dtype)
        check_same_tokenizer(target, draft)
        try:
            draft.model.restrict_vocab(read_draft_vocab(Path(config.speculative_model), target.model.spec.vocab_size))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return DraftModelMethod(draft.model, target.model.spec.vocab_size)
    raise ConfigError(f"unknown method {config.method!r}")


def build_medusa(config: DeploymentConfig, target: LoadedModel):
    from specserve.speculative.choices import DEFAULT_CHOICES
    from specserve.speculative.medusa import load_medusa
    from specserve.speculative.proposers import MedusaMethod

    if not config.speculative_model:
        raise ConfigError("Medusa needs speculative_model (the directory of the Medusa heads)")
    spec = target.model.spec
    try:
        heads = load_medusa(config.speculative_model, spec.hidden_size, spec.vocab_size, dtype=target.model.dtype)
        return MedusaMethod(heads, config.medusa_choices or DEFAULT_CHOICES, config.typical)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot use Medusa heads {config.speculative_model}: {exc}") from None


def build_eagle(config: DeploymentConfig, target: LoadedModel):
    from specserve.speculative.choices import DEFAULT_CHOICES
    from specserve.speculative.eagle import default_aux_layer_ids, load_eagle
    from specserve.speculative.eagle_draft import EagleMethod

    kind = "eagle3" if config.method == "eagle3" else "eagle"
    if not config.speculative_model:
        raise ConfigError(f"{config.method} needs speculative_model (the directory of the EAGLE head)")
    spec = target.model.spec
    try:
        head = load_eagle(config.speculative_model, kind, spec, dtype=target.model.dtype)
        aux = config.eagle3_layers or head.config.aux_layer_ids or default_aux_layer_ids(spec.num_layers)
        if any(not 1 <= int(i) <= spec.num_layers for i in aux):
            raise ValueError(f"EAGLE-3 target layers {aux} must lie in 1..{spec.num_layers}")
        static = config.method == "eagle" or config.eagle_choices is not None
        choices = (config.eagle_choices or DEFAULT_CHOICES) if static else None
        verify_seconds = target_verify_seconds(target) if config.adaptive_draft_len else None
        lookup = (config.prompt_lookup_min, config.prompt_lookup_max) if config.prompt_lookup_branch else None
        return EagleMethod(head, target.model, config.method_label, config.max_draft_len, top_k=config.top_k,
                           total_tokens=config.total_tokens, choices=choices, aux_layer_ids=aux,
                           verify_seconds=verify_seconds, lookup=lookup)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"cannot use EAGLE head {config.speculative_model}: {exc}") from None


_VERIFY_COSTS: dict[int, object] = {}


def target_verify_seconds(target: LoadedModel):
    """The target's measured cost of one forward of n tokens: measured once per model, dtype and machine, and
    kept in the cache directory (a few seconds saved on every later start)."""
    import json
    import platform

    import torch

    from specserve.engine.batch import StepCosts
    from specserve.engine.engine import Engine
    from specserve.models import cpu_kernels
    from specserve.models.loader import cache_root

    if id(target.model) in _VERIFY_COSTS:
        return _VERIFY_COSTS[id(target.model)]
    key = f"{Path(target.path).resolve()}|{target.model.dtype}|{target.model.quantization}|" \
          f"{platform.processor() or platform.machine()}|{torch.get_num_threads()}|{torch.__version__}|" \
          f"{target.model.kernels_usable}|{cpu_kernels.f32_linear_available()}"
    file = cache_root() / "verify_costs.json"
    try:
        table = json.loads(file.read_text()) if file.exists() else {}
    except ValueError:
        table = {}
    if key in table:
        costs = StepCosts(None, 1, table[key])
    else:
        costs = StepCosts(Engine(target), rows=1)
        table[key] = costs.seconds
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(file)
    _VERIFY_COSTS[id(target.model)] = costs
    return costs


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ConfigError(
            f"draft model {draft.name} does not share the target's tokenizer "
            f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens): speculation needs the same vocabulary")


def build_engine(config: DeploymentConfig, target: LoadedModel | None = None):
    from specserve.engine.engine import Engine

    target = target or load_model(config.model, dtype=config.dtype, quantization=config.quantization)
    method = build_method(config, target)
    return Engine(target, method, config.max_draft_len if method else 0, config.max_model_len)
