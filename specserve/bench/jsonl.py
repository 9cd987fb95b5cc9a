"""Reading JSON-lines files (prompt sets, question.jsonl) with errors that name the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def read_jsonl(path: str | Path, error: type[Exception], hint: str = "") -> Iterator[tuple[int, object]]:
    """(line number, parsed value) for each non-blank line; `error` for a missing or unreadable file or a line
    that is not JSON (with `hint` appended)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise error(f"input file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{number}: not valid JSON ({exc.msg}){hint}") from None
        yield number, value
