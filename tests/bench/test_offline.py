"""The offline benchmark's prompt files."""

from __future__ import annotations

import pytest

from specserve.bench.offline import load_prompts
from specserve.config import ConfigError
from tests.test_config import write


def test_prompt_files(tmp_path):
    eagle = write(tmp_path / "q.jsonl", '{"question_id": 0, "turns": ["first", "second"]}\n\n'
                                        '{"question_id": 1, "turns": ["other"]}\n')
    assert load_prompts(eagle) == ["first", "other"]
    assert load_prompts(eagle, 1) == ["first"]
    assert load_prompts(write(tmp_path / "g.jsonl", '{"text": "hi"}\n')) == ["hi"]
    for bad, needle in [("", "no prompts"), ("{not json\n", "not valid JSON"), ('{"turns": []}\n', "expected")]:
        with pytest.raises(ConfigError, match=needle):
            load_prompts(write(tmp_path / "bad.jsonl", bad))
