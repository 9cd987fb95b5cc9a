"""The built-in training prompts: Python standard library functions to complete, plus general instructions.

Nothing can be downloaded here and the benchmark prompts must stay held out, so the set is made from material on
the machine: every documented public function of the standard library becomes "its signature and docstring,
complete the body" (the shape of a HumanEval prompt), and a few general instructions written for the purpose
keep chat-style text in the mix. Deterministic for a seed.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "ensurepip",
             "__pycache__", "tkinter", "pydoc_data"}

GENERAL_INSTRUCTIONS = [
    "Explain what a hash table is and when you would use one.",
    "Write a short story about a robot who learns to paint.",
    "Summarize the main causes of the water cycle in a few sentences.",
    "List five tips for writing readable code.",
    "What is the difference between a list and a tuple in Python?",
    "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
    "Describe how to make a cup of tea, step by step.",
    "Explain recursion to a beginner with a simple example.",
    "Write a haiku about autumn leaves.",
    "What are the benefits of unit testing?",
    "Give three reasons why the sky appears blue.",
    "Explain the difference between a process and a thread.",
    "Write a polite email asking a colleague to review a pull request.",
    "How does binary search work? Explain its time complexity.",
    "Describe the plot of a mystery story set in a small village.",
    "What is a closure in programming? Give an example in Python.",
    "If a rectangle has a perimeter of 30 and a width of 5, what is its area?",
    "Explain what an API is to someone who does not program.",
    "List the steps to debug a program that crashes on startup.",
    "Write a limerick about a cat who loves to code.",
    "Explain the difference between stack and heap memory.",
    "What is the purpose of a virtual environment in Python?",
    "Describe how a web browser loads a page.",
    "Write a function in words that checks whether a string is a palindrome.",
    "Explain what Big-O notation means.",
    "Give a short biography of a fictional inventor.",
    "How do you sort a dictionary by its values in Python?",
    "What is the difference between == and is in Python?",
    "Explain how a linked list differs from an array.",
    "Write a motivational message for a student before an exam.",
    "Explain what a regular expression is and give two examples.",
    "What happens when you type a command into a terminal and press enter?",
    "Describe three common sorting algorithms and compare them.",
    "Explain how to read a CSV file in Python.",
    "Write a dialogue between a teacher and a curious student about the moon.",
    "What is dynamic programming? Illustrate it with the Fibonacci numbers.",
    "Explain the meaning of immutability with an example.",
    "A shop sells pens at 3 for 2 dollars. How much do 12 pens cost?",
    "List the planets of the solar system in order from the sun.",
    "Explain why code reviews are useful for a team.",
]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def function_prompts(path: Path) -> list[str]:
    """Each documented public function or method with a body of 3+ statements: its header and docstring."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or len(node.body) < 4:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        block = lines[node.lineno - 1: doc.end_lineno]
        indent = len(block[0]) - len(block[0].lstrip())
        text = "\n".join(line[indent:] if line[:indent].isspace() or not line[:indent] else line for line in block)
        if text.isascii() and 40 <= len(text) <= 1200:
            prompts.append(text + "\n")
    return prompts


def code_prompts(seed: int = 0) -> list[str]:
    seen: dict[str, None] = {}
    for path in stdlib_files():
        for prompt in function_prompts(path):
            seen.setdefault(prompt)
    prompts = sorted(seen)
    random.Random(seed).shuffle(prompts)
    return prompts


def build_prompt_set(num_code: int | None = None, seed: int = 0) -> list[str]:
    """Code prompts (all, or the first num_code after shuffling) and the general instructions, shuffled."""
    prompts = code_prompts(seed)[:num_code] + GENERAL_INSTRUCTIONS
    random.Random(seed + 1).shuffle(prompts)
    return prompts



def distill_prompt_set(prompt_files: list[Path], seed: int = 0) -> list[str]:
    """The head-training set: specserve's general questions, the openly licensed prompt files (first turns;
    sources and licenses in specserve/heads/README.md) and the stdlib code prompts, deduplicated and shuffled
    together, so that any prefix of the set (a partial run) holds each kind in proportion."""
    from specserve.train.general_prompts import general_prompts
    from specserve.train.prompt_files import read_prompt_file

    prompts = general_prompts(seed) + code_prompts(seed)
    for path in prompt_files:
        prompts += read_prompt_file(path)
    prompts = list(dict.fromkeys(prompts))
    random.Random(seed + 2).shuffle(prompts)
    return prompts
