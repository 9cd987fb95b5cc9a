"""The tutorials' dataset converter (Triton tutorials, Feature_Guide/Speculative_Decoding/dataset-converter.py):
EAGLE / MT-bench `question.jsonl` -> genai-perf input JSONL, one `{"text": turn}` line per turn, in file order.

    specserve convert-dataset --input_file question.jsonl --output_file converted_humaneval.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.bench.jsonl import read_jsonl


class ConvertError(ValueError):
    """A bad input file: the message names the file and the line."""


def convert_records(path: str | Path) -> tuple[list[dict], int]:
    """question.jsonl -> ([{"text": turn}, ...], lines skipped). Every turn of every question, in order;
    every other field is dropped; a line without a "turns" list is skipped (as the tutorials' script does);
    blank lines are ignored; a line that is not JSON is an error."""
    out: list[dict] = []
    skipped = 0
    for _, record in read_jsonl(path, ConvertError):
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            skipped += 1
            continue
        out.extend({"text": turn} for turn in turns)
    return out, skipped


def convert_dataset(input_file: str | Path, output_file: str | Path) -> int:
    """Write the converted file; returns the number of lines written. Raises ConvertError."""
    records, skipped = convert_records(input_file)
    if not records:
        what = f"none of its {skipped} records has a 'turns' list" if skipped else "the file is empty"
        raise ConvertError(f"{input_file}: no turns to convert ({what}); expected EAGLE / MT-bench "
                           "question.jsonl lines like {\"question_id\": 0, \"turns\": [\"...\"]}")
    try:
        with open(output_file, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")  # json.dumps defaults, as the tutorials' script
    except OSError as exc:
        raise ConvertError(f"cannot write {output_file}: {exc}") from None
    return len(records)
