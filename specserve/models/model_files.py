"""Where models' files are: specserve's cache directory and the directories converted into it, and the error a
model that cannot be found or read raises."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """The model can't be found or read: a user error with a message that names the problem."""


def cache_root() -> Path:
    root = Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


CONVERTED_LAYOUT = 3  # what a converted directory holds; a new value converts every file again


def converted_dir(kind: str, source: Path) -> Path:
    """Where the HF directory converted from `source` is cached (keyed by its path, size, mtime and layout)."""
    stat = source.stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTED_LAYOUT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / kind / f"{source.stem}-{digest}"


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


SOURCE_FILE = "source.txt"  # in a converted directory: the resolved path of the file it was converted from


def converted_in_place(staging: Path, out: Path, source: Path) -> None:
    """Move a finished conversion `staging` to `out` and remove the directories converted from earlier versions
    of the same file (another size or mtime): a model updated in place does not leave its old copies behind."""
    (staging / SOURCE_FILE).write_text(str(source.resolve()))
    staging.rename(out)
    for other in out.parent.glob(f"{source.stem}-*"):
        recorded = other / SOURCE_FILE
        if other != out and recorded.exists() and recorded.read_text() == str(source.resolve()):
            shutil.rmtree(other, ignore_errors=True)
