"""Heads trained for the embedded default model and shipped inside the package.

`--method eagle3` (or `eagle`, `eagle2`, their `+ngram` / `+suffix` forms) on the embedded default drafts with the
head under `heads/<model>/<kind>/` when no head is named; a head the user names (`speculative_model`, `--head`,
`--draft-model`) always wins. Each head sits in its method's published layout (config.json + model.safetensors),
so it also loads as an ordinary head directory. `heads/README.md` records how each one was made (command, data,
steps, CPU time, held-out acceptance), enough to rebuild it from its seed.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = SHIPPED_DIR / "gemma-3-270m"  # the embedded default's heads (models.loader.DEFAULT_MODEL)


def shipped_head(kind: str, target) -> Path | None:
    """The directory of the head of `kind` shipped for `target` (a LoadedModel), or None: only the embedded
    default has shipped heads, and only for the kinds listed in heads/README.md."""
    if not getattr(target, "embedded_default", False):
        return None
    path = DEFAULT_MODEL_DIR / kind
    return path if (path / "config.json").is_file() else None


def shipped_kinds() -> list[str]:
    """The head kinds shipped for the embedded default."""
    if not DEFAULT_MODEL_DIR.is_dir():
        return []
    return sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir() if (p / "config.json").is_file())
