"""A GGUF file converted once into what specserve runs: its config, tokenizer and the few tensors that do not run
packed (norms, biases) in an HF-style directory under the cache, and its quantized linears and embedding
repacked into the kernel's layout (models/quant.py) beside them, q/k/v and gate/up already fused, so a load
maps the packed file as it is. transformers' GGUF functions read the metadata (config, tokenizer, tensor names
and each family's tensor processing), through one shared reader (models/gguf_file.py).
"""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from specserve.models import gguf_file, quant
from specserve.models.model_files import ModelLoadError, converted_dir, converted_in_place, strip_prefixes
from specserve.models.quant import PackedWeight, QuantizationError
from specserve.models.transformer import CausalLM


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """A GGUF file's config, tokenizer and unpacked tensors (norms, biases, linears stored in F16/F32) in a cached
    HF-style directory. The quantized linears and embedding are not in it: they run packed from the GGUF
    (gguf_packed_weights), or are dequantized in memory when asked (dense_weights)."""
    return converted_gguf(gguf_path)[0]


def converted_gguf(gguf_path: Path) -> tuple[Path, object | None]:
    """(gguf_to_hf_dir's directory, the tokenizer if it was made from the file just now: reading a large
    vocabulary back from the directory costs seconds)."""
    out = converted_dir("gguf", gguf_path)
    if (out / "model.safetensors").exists():
        return out, None
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    print(f"specserve: reading {gguf_path.name}'s config, tokenizer and norms, and packing its blocks, once (into "
          f"{out}) ...", file=sys.stderr, flush=True)
    staging = out.with_name(out.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with gguf_file.shared_readers(transformers=True), ThreadPoolExecutor(1) as pool:
            config = gguf_config(gguf_path)
            # the blocks' packing (numpy, mostly off the GIL) beside the tokenizer's conversion (Python)
            packing = pool.submit(_cache_packed, gguf_file.read(gguf_path), gguf_path.name, config,
                                  staging / PACKED_FILE)
            tensors = unpacked_gguf_tensors(gguf_path, config)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            packing.result()
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    config.save_pretrained(staging)
    save_tokenizer(tokenizer, staging)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(staging / "model.safetensors"))
    converted_in_place(staging, out, gguf_path)
    return out, tokenizer


def _cache_packed(reader, name: str, hf_config, path: Path) -> None:
    """The GGUF's packed blocks saved to `path`; a block the kernels cannot run leaves none (the load that needs
    them stops on it then, with the tensor's name: a dense load does not)."""
    try:
        quant.save_packed(_pack_gguf(reader, name, hf_config), path)
    except (ModelLoadError, QuantizationError):
        pass


def save_tokenizer(tokenizer, directory: Path) -> None:
    """tokenizer.save_pretrained, with its added tokens also in tokenizer_config.json: without them transformers
    parses the whole tokenizer.json in Python at every load to find them (1.4 s of the default model's 3.5 s)."""
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.setdefault("added_tokens_decoder", {str(i): token.__getstate__()
                                               for i, token in tokenizer.added_tokens_decoder.items()})
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def unpacked_gguf_tensors(gguf_path: Path, config) -> dict[str, torch.Tensor]:
    """The GGUF's tensors that do not run packed (norms, biases, linears stored in F16/F32), by HF name, named and
    converted as transformers' GGUF loader does (its weights map and its family's tensor processor: Gemma's norm
    offset, Llama's q/k row order); the packed ones are never dequantized."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with gguf_file.shared_readers(transformers=True):
        parsed = {"config": hf_gguf().load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"],
                  "tensors": {}}
    reader = gguf_file.read(gguf_path)
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    with torch.device("meta"):  # specserve's model has transformers' parameter names (its modeling import: ~2.5 s)
        names = get_gguf_hf_weights_map(CausalLM(config), processor, config.model_type, config.num_hidden_layers)
    out = {}
    for tensor in reader.tensors:
        if _packable(tensor):
            continue
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            out[names[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
    return strip_prefixes(out)


def _packable(tensor) -> bool:
    """Whether _pack_gguf packs this GGUF tensor: a quantized linear, embedding or lm_head."""
    return gguf_hf_name(tensor.name) is not None and tensor.tensor_type.name not in _GGUF_DENSE_TYPES


def gguf_config(gguf_path: Path):
    """The transformers config that a GGUF file's metadata describes."""
    from transformers import AutoConfig

    with gguf_file.shared_readers(transformers=True):
        config_dict = dict(hf_gguf().load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"])
    config_dict.pop("quantization_config", None)
    return AutoConfig.for_model(**config_dict)


def dequantized_gguf(gguf_path: Path, config) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file as fp32 under its HF name (transformers' GGUF reader)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    with gguf_file.shared_readers(transformers=True):
        return hf_gguf().load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]


def hf_gguf():
    """transformers' GGUF module: its functions looked up at call time, so that a shared_readers block's
    replacements apply (a name imported from it before the block would keep the original)."""
    import transformers.modeling_gguf_pytorch_utils as module

    return module


_GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
_GGUF_DENSE_TYPES = ("F32", "F16", "BF16")


def gguf_hf_name(name: str) -> str | None:
    """The HF parameter a GGUF tensor of a llama-like model holds, for the tensors that can be packed."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match and match[2] in _GGUF_LINEARS:
        return f"model.layers.{match[1]}.{_GGUF_LINEARS[match[2]]}.weight"
    return None


def llama_row_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rope halves of Llama's q/k rows; this undoes it (as transformers)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


PACKED_FILE = "specserve-packed.st"  # not *.safetensors: the dense reader globs those


def gguf_packed_weights(gguf_path: Path, hf_config, cache_dir: Path) -> dict[str, PackedWeight]:
    """The GGUF's quantized linears and embedding, packed for the kernel, by HF parameter name; packed once
    (usually with the GGUF's conversion, converted_gguf) and mapped from `cache_dir` (its converted directory)."""
    cached = cache_dir / PACKED_FILE
    if cached.exists():
        packed = quant.load_packed(cached)
        if packed is not None:
            return packed
    packed = _pack_gguf(gguf_file.read(gguf_path), gguf_path.name, hf_config)
    try:
        quant.save_packed(packed, cached)
    except OSError as exc:  # a read-only cache only costs the next start the packing again
        print(f"specserve: could not cache packed weights in {cached}: {exc}", file=sys.stderr)
        return packed
    return quant.load_packed(cached) or packed  # read back from the file: the memory they were packed in is freed


FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def fuse_projection_groups(packed: dict[str, PackedWeight]) -> None:
    """Concatenate each layer's q/k/v and gate/up as the model's fuse_projections does (the parts become views of
    the fused weights), so that the cache holds the layout the kernels run and a load maps it without a copy."""
    for name in packed:
        if name.endswith(".self_attn.q_proj.weight"):
            layer = name.removesuffix("self_attn.q_proj.weight")
            for group in FUSED_GROUPS:
                parts = [f"{layer}{part}.weight" for part in group]
                if all(part in packed for part in parts):
                    PackedWeight.fuse_runs([packed[part] for part in parts])


def _pack_gguf(reader, name: str, hf_config) -> dict[str, PackedWeight]:
    """The quantized tensors of a GGUF file (`reader`, `name`) in the kernel's layout, q/k/v and gate/up fused."""
    packed = {}
    for tensor in reader.tensors:
        if not _packable(tensor):
            continue
        kind, hf_name = tensor.tensor_type.name, gguf_hf_name(tensor.name)
        in_features, out_features = (int(d) for d in tensor.shape[:2])
        raw = tensor.data
        if hf_config.model_type == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = hf_config.num_attention_heads if ".attn_q." in tensor.name else hf_config.num_key_value_heads
            raw = raw[llama_row_order(out_features, heads)]
        try:
            codes = quant.decode_gguf(kind, raw, (out_features, in_features))
        except QuantizationError as exc:
            raise ModelLoadError(f"{name}: {tensor.name}: {exc}") from None
        packed[hf_name] = PackedWeight.from_codes(codes)
    fuse_projection_groups(packed)
    return packed
