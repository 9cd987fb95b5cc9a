"""The built-in training prompts: HumanEval-shaped stdlib functions plus instructions, deterministic, and never
the benchmark prompts."""

from __future__ import annotations

import pytest

from specserve.train.prompt_set import GENERAL_INSTRUCTIONS, build_prompt_set, code_prompts


@pytest.fixture(scope="module")
def code():
    return code_prompts()


def test_code_prompts_are_signatures_with_docstrings(code):
    assert len(code) > 1000 and len(set(code)) == len(code)
    for prompt in code[:200]:
        assert prompt.startswith("def ") and prompt.rstrip()[-1] in "\"'" and prompt.isascii()  # ends its docstring


def test_prompt_set_is_deterministic_and_mixed(code):
    first, again = build_prompt_set(100, seed=3), build_prompt_set(100, seed=3)
    assert first == again and first != build_prompt_set(100, seed=4)
    assert len(first) == 100 + len(GENERAL_INSTRUCTIONS) and set(GENERAL_INSTRUCTIONS) <= set(first)

