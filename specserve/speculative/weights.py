"""Reading and writing a head's state dict as its authors publish it: a safetensors file or a torch pickle."""

from __future__ import annotations

from pathlib import Path

import torch


def write_weights(module: torch.nn.Module | dict, path: Path, file_name: str) -> None:
    """`module.state_dict()` (or a state dict) into path/file_name (.safetensors or a torch.save file)."""
    state = module if isinstance(module, dict) else module.state_dict()
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    if file_name.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(state, str(path / file_name))
    else:
        torch.save(state, path / file_name)


def read_weights(path: Path, safetensors_name: str, torch_name: str) -> dict[str, torch.Tensor]:
    """The state dict in path/safetensors_name, else path/torch_name (loaded without executing code)."""
    if (path / safetensors_name).exists():
        from safetensors.torch import load_file
        return load_file(str(path / safetensors_name))
    if (path / torch_name).exists():
        return torch.load(path / torch_name, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} holds neither {safetensors_name} nor {torch_name}")


DRAFT_VOCAB_FILE = "draft_vocab.json"


def write_draft_vocab(path: Path, token_ids: torch.Tensor) -> None:
    """specserve's draft vocabulary next to a draft model (in its directory, or beside its GGUF file) or Medusa
    heads (other tools ignore the file): the target token ids the draft computes logits for."""
    import json
    draft_vocab_file(path).write_text(json.dumps({"token_ids": [int(i) for i in token_ids]}))


def draft_vocab_file(path: Path) -> Path:
    """Where a draft's vocabulary lies: draft_vocab.json in its directory, or for a file (a GGUF draft model)
    <its stem>.draft_vocab.json beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{DRAFT_VOCAB_FILE}") if path.is_file() else path / DRAFT_VOCAB_FILE


def read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    import json
    file = draft_vocab_file(path)
    if not file.exists():
        return None
    try:
        ids = torch.tensor(json.loads(file.read_text())["token_ids"], dtype=torch.long)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file} is not a draft vocabulary ({exc})") from None
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{file} lists token ids outside the target's vocabulary of {vocab_size}")
    return ids


def check_layout(path: Path, what: str, expected: dict, state: dict, ignored=lambda key: False) -> None:
    """ValueError naming missing / unknown tensors and wrong shapes of a head's state dict."""
    missing = [k for k in expected if k not in state]
    unknown = [k for k in state if k not in expected and not ignored(k)]
    if missing or unknown:
        raise ValueError(f"{path}: not the {what}: missing {missing[:4]}, unknown {unknown[:4]}")
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(state[key].shape)}, expected {tuple(value.shape)}")
