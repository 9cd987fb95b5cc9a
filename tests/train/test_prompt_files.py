"""Prompt files read back as written, bad ones are refused naming file and line, and evaluation prompts never
slip into a training set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.train.prompt_files import check_held_out, read_prompt_file, write_prompts
from specserve.train.prompt_set import GENERAL_INSTRUCTIONS, build_prompt_set, code_prompts

HUMANEVAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval_question.jsonl"
EVAL_PROMPT = ('Complete the code I provided.\n\ndef add(a: int, b: int) -> int:\n    """Add a and b.\n'
               '    >>> add(2, 3)\n    5\n    """\n')


@pytest.fixture(scope="module")
def code() -> list[str]:
    return code_prompts()[:300]


def test_write_then_read_round_trip(tmp_path, code):
    prompts = code[:20] + GENERAL_INSTRUCTIONS[:5] + ["unicode: caf\u00e9 \u2713"]
    path = tmp_path / "sub" / "train.jsonl"
    write_prompts(path, prompts)
    assert read_prompt_file(path) == prompts
    assert json.loads(path.read_text().splitlines()[0]) == {"text": prompts[0]}


def test_reads_eagle_turns_and_text_paragraphs(tmp_path):
    eagle = tmp_path / "question.jsonl"
    eagle.write_text('{"question_id": 0, "turns": ["first", "second"]}\n\n{"text": "plain"}\n')
    assert read_prompt_file(eagle) == ["first", "plain"]
    txt = tmp_path / "prompts.txt"
    txt.write_text("Write a poem.\nAbout rain.\n\n  \nExplain tides.\n\n\n")
    assert read_prompt_file(txt) == ["Write a poem.\nAbout rain.", "Explain tides."]


@pytest.mark.parametrize(("name", "content", "message"), [
    ("empty.jsonl", "", r"empty.jsonl is empty"),
    ("blank.jsonl", "\n  \n", r"blank.jsonl is empty"),
    ("empty.txt", "\n\n", r"empty.txt is empty"),
    ("broken.jsonl", '{"text": "ok"}\n{"text": \n', r"broken.jsonl:2: not valid JSON"),
    ("no_text.jsonl", '{"text": "ok"}\n{"prompt": "x"}\n', r"no_text.jsonl:2: no usable prompt"),
    ("blank_text.jsonl", '{"text": "  "}\n', r"blank_text.jsonl:1: no usable prompt"),
    ("no_turns.jsonl", '{"turns": []}\n', r"no_turns.jsonl:1: no usable prompt"),
    ("list.jsonl", '["a"]\n', r"list.jsonl:1: no usable prompt"),
])
def test_bad_prompt_files_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_prompt_file(path)


def test_missing_file_and_blank_prompt_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        write_prompts(tmp_path / "out.jsonl", ["fine", "   "])


def test_held_out_guard_refuses_evaluation_prompts():
    evaluation = [EVAL_PROMPT]
    check_held_out(["def sub(a, b):\n    \"\"\"Subtract.\"\"\"\n", "Write a poem."], evaluation)
    check_held_out(["Complete the code I provided."], evaluation)  # a small piece of one is not the prompt
    spaced = 'Complete   the code I provided. def add(a: int,\nb: int) -> int: """Add a and b. >>> add(2, 3) 5 """'
    for leaked in (evaluation[0],  # the same prompt
                   spaced,  # the same up to whitespace
                   "# preamble\n" + evaluation[0] + "\nmore",  # containing it
                   evaluation[0].removeprefix("Complete the code I provided.\n\n")):  # it without the instruction
        with pytest.raises(ValueError, match="training prompt 1 .* evaluation prompt"):
            check_held_out(["Write a poem.", leaked], evaluation)


@pytest.mark.skipif(not HUMANEVAL.exists(), reason="the shared evaluation prompts are not on this machine")
def test_the_built_set_keeps_humaneval_held_out(code):
    humaneval = read_prompt_file(HUMANEVAL)
    assert len(humaneval) == 80
    check_held_out(build_prompt_set(), humaneval)
    with pytest.raises(ValueError, match="evaluation prompt"):
        check_held_out(code[:50] + [humaneval[7]], humaneval)
