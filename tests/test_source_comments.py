"""Comments state rules; the measurements behind them live in docs/design-notes.md (and docs/benchmarks.md)."""

from __future__ import annotations

import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "specserve"
MEASURED = re.compile(r"\b\d+\.\d+x\b|\b\d+(\.\d+)? ?(ms|us)\b|\d+(\.\d+)? ?GB/s")
# lines that build text a program prints (a message, a table, a format) may carry such figures
PRINTED = re.compile(r"f\"|f'|help=|typer\.echo|print\(|:\.\d+f|\{[a-z_]+\}")


def test_no_comment_or_docstring_quotes_a_measured_ratio_or_time():
    found = []
    for path in sorted(SOURCE.rglob("*")):
        if path.suffix not in {".py", ".inc", ".cpp", ".h"}:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if MEASURED.search(line) and not PRINTED.search(line):
                found.append(f"{path.relative_to(SOURCE.parent)}:{number}: {line.strip()}")
    assert not found, "measured figures in comments (move them to docs/design-notes.md):\n" + "\n".join(found)
