"""Where models' files are: specserve's cache directory and the directories converted into it, and the error a
model that cannot be found or read raises."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """The model can't be found or read: a user error with a message that names the problem."""


def cache_root() -> Path:
    """$SPECSERVE_CACHE, or ~/.cache/specserve where it is unset or empty (as settings.py reads every variable)."""
    root = Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")
    root.mkdir(parents=True, exist_ok=True)
    return root


CONVERTED_LAYOUT = 3  # what a converted directory holds; a new value converts every file again
DIGEST_CHARS = 16  # of a converted directory's name: <file stem>-<digest>


def converted_dir(kind: str, source: Path) -> Path:
    """Where the HF directory converted from `source` is cached (keyed by its path, size, mtime and layout)."""
    stat = source.stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTED_LAYOUT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:DIGEST_CHARS]
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
    of the same file (another size or mtime), and those of its name that an earlier specserve wrote (no source
    recorded: an older layout, such as the fp32 copies of the weights): a model updated in place, or specserve
    itself, does not leave old copies behind. A removed directory of another file of that name is a cache: that
    file is converted again when next loaded."""
    (staging / SOURCE_FILE).write_text(str(source.resolve()))
    staging.rename(out)
    for other in out.parent.glob(glob.escape(source.stem) + "-" + "[0-9a-f]" * DIGEST_CHARS):
        recorded = other / SOURCE_FILE
        if other != out and (not recorded.exists() or recorded.read_text() == str(source.resolve())):
            shutil.rmtree(other, ignore_errors=True)
