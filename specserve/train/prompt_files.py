"""Prompt files for training and evaluation: write and read them, and keep evaluation prompts out of training.

JSONL with `{"text": ...}` lines (genai-perf's format) or EAGLE's `{"turns": [...]}` lines (the first turn), or a
.txt file with one prompt per paragraph.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from specserve.bench.jsonl import read_jsonl


def write_prompts(path: str | Path, prompts: list[str]) -> None:
    """One `{"text": prompt}` JSON line per prompt: genai-perf's input format, which specserve's loaders read."""
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt {index} is empty or not a string: it would not read back as a prompt")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in prompts), encoding="utf-8")


def prompt_of(record: object, where: str) -> str:
    text = None
    if isinstance(record, dict):
        text = record.get("text")
        if text is None and isinstance(record.get("turns"), list) and record["turns"]:
            text = record["turns"][0]  # EAGLE / MT-bench question: the first turn is the prompt
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: no usable prompt (expected a non-empty string in 'text', or a 'turns' list whose "
                         f"first item is one)")
    return text


def read_paragraphs(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"prompt file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return [paragraph.strip() for paragraph in re.split(r"\n[ \t]*\n", text) if paragraph.strip()]


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a JSONL file (`{"text": ...}` lines, or EAGLE `{"turns": [...]}` lines: the first turn) or a
    .txt file (one prompt per paragraph, paragraphs separated by blank lines). ValueError naming the file (and the
    line) for a missing or empty file, a line that is not JSON, or a line without a usable prompt."""
    path = Path(path)
    if path.suffix == ".txt":
        prompts = read_paragraphs(path)
    else:
        hint = " (expected one JSON object a line, or a .txt file with one prompt per paragraph)"
        prompts = [prompt_of(record, f"{path}:{number}") for number, record in read_jsonl(path, ValueError, hint)]
    if not prompts:
        raise ValueError(f"prompt file {path} is empty: no prompts in it")
    return prompts


def normalize_whitespace(text: str) -> str:
    return " ".join(text.split())


def check_held_out(prompts: list[str], eval_prompts: list[str]) -> None:
    """ValueError when a training prompt equals or contains an evaluation prompt, whitespace ignored; also when it
    is most (half or more) of one, which catches a benchmark prompt used without its instruction prefix (HumanEval's
    own prompt against EAGLE's "Complete the code I provided. <prompt>"). Training on evaluation prompts would
    overstate the head's acceptance."""
    held_out = [text for text in map(normalize_whitespace, eval_prompts) if text]
    for index, prompt in enumerate(prompts):
        text = normalize_whitespace(prompt)
        for other in held_out:
            if other in text or (text and 2 * len(text) >= len(other) and text in other):
                raise ValueError(f"training prompt {index} ({text[:60]!r}...) overlaps the evaluation prompt "
                                 f"{other[:60]!r}...: keep the evaluation prompts out of the training set")
