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


def test_multiply_adds_per_token_counts_every_projection_and_the_lm_head():
    from types import SimpleNamespace

    from specserve.bench.offline import multiply_adds_per_token

    # Llama-3.2-1B: 1.236 G parameters with its tied 128256 x 2048 table counted once, as the lm_head
    spec = SimpleNamespace(hidden_size=2048, head_dim=64, num_heads=32, num_kv_heads=8, num_layers=16,
                           intermediate_size=8192, vocab_size=128256)
    assert multiply_adds_per_token(spec) == 16 * (2048 * 64 * 80 + 3 * 2048 * 8192) + 128256 * 2048
    assert abs(multiply_adds_per_token(spec) / 1.236e9 - 1) < 0.01


def test_the_int8_peak_probe_measures_the_multiply_instruction():
    from specserve.models.quant import int8_peak_macs, quant_path

    peak = int8_peak_macs(0.01)
    if quant_path() == "scalar":
        assert peak == 0.0
    else:  # a finite rate: an instruction folded away would read as (near) infinite, a broken timer as zero
        assert 1e9 < peak < 1e14


@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_the_rates_name_and_probe_the_path_the_kernels_run(path, monkeypatch):
    """SPECSERVE_KERNELS picks a slower variant than the CPU's best: --step-costs must name its quantized path and
    read its rates against that path's own peak, not the best path's."""
    from types import SimpleNamespace

    from specserve.bench.offline import compute_rates
    from specserve.models import cpu_kernels, quant
    from tests.models.test_quant import isa_paths

    if path not in isa_paths():
        pytest.skip(f"this CPU does not run the {path} path")
    monkeypatch.setenv(cpu_kernels.ENV, path)
    spec = SimpleNamespace(hidden_size=64, head_dim=16, num_heads=4, num_kv_heads=2, num_layers=2,
                           intermediate_size=128, vocab_size=256)
    rates = compute_rates(SimpleNamespace(spec=spec), {1: 1.0})
    assert rates["isa"] == path == quant.quant_path()
    assert (rates["int8_peak_gmacs"] == 0.0) == (path == "scalar")
