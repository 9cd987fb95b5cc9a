"""Files written whole or not at all: the caches and checkpoints specserve keeps across runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

PARTIAL_SUFFIX = ".partial"


def write_atomically(path: Path | str, write: Callable[[Path], object]) -> None:
    """`write(temporary path)`, then the file renamed to `path`: a reader never sees half a file, and a write that
    fails or is killed leaves none behind. The temporary name carries the process id, so two processes writing the
    same file at once do not write into each other's."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path | str, text: str) -> None:
    write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"))
