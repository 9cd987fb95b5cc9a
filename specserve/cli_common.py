"""What the `specserve` commands share: the error exit, and the check of a result file before a long run."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def check_output_file(path: Path | None) -> None:
    """Fail before a long run, not after it, when its result file cannot be written (missing folders are made)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot write {path}: {exc}")
    if path.is_dir() or not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"cannot write {path}: a folder, or not writable")
