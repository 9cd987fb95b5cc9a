"""benchmarks/report.py's outputs from a run's JSON: the README table between its markers, and the charts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "report.py"


@pytest.fixture()
def report_module(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    monkeypatch.setattr(module, "README", tmp_path / "README.md")
    return module


def run(methods: dict) -> dict:
    return {"num_prompts": 4, "max_tokens": 64,
            "methods": {name: {"tokens_per_s": tps, "speedup_vs_ar": tps / methods["ar"]}
                        for name, tps in methods.items()}}


REPORT = {"cpu": {"model": "Test CPU", "cores": 2, "kernel_path": "avx2", "slug": "test-cpu-2c-avx2"},
          "quick": True, "offline": {"general": run({"ar": 50.0, "ngram": 100.0}),
                                     "humaneval": run({"ar": 40.0, "ngram": 60.0})},
          "step_costs": {"forward_ms_by_tokens": {"1": 10.0, "2": 11.0, "8": 14.0}}}


def test_the_readme_table_is_rewritten_between_its_markers_only(report_module):
    readme = report_module.README
    readme.write_text(f"# title\n{report_module.START}\nold table\n{report_module.END}\nrest\n")
    report_module.update_readme(report_module.readme_table(REPORT))
    text = readme.read_text()
    assert text.startswith("# title\n") and text.endswith(f"{report_module.END}\nrest\n")
    assert "old table" not in text
    assert "| `ngram` | 100.0 | 2.00x | 60.0 | 1.50x |" in text
    assert "Test CPU, 2 cores (avx2 kernels)" in text and "--quick" in text
    assert "docs/results/test-cpu-2c-avx2-speed.png" in text


def test_a_readme_without_markers_is_left_alone(report_module):
    report_module.README.write_text("no markers\n")
    report_module.update_readme("table")
    assert report_module.README.read_text() == "no markers\n"


def test_charts_are_written(report_module):
    report_module.charts(REPORT)
    for name in ("test-cpu-2c-avx2-speed.png", "test-cpu-2c-avx2-step-costs.png"):
        assert (report_module.RESULTS / name).read_bytes().startswith(b"\x89PNG")


def test_the_cpu_is_named_with_its_kernel_path(report_module):
    cpu = report_module.cpu()
    assert cpu["cores"] >= 1 and cpu["kernel_path"] in ("amx", "avx512-vnni", "avx2", "generic")
    assert cpu["slug"].endswith(cpu["kernel_path"])


def test_the_server_line_reads_fresh_and_saved_levels(report_module):
    # a fresh run keys the levels by int, a saved one (JSON) by str
    for levels in ({1: {"tokens_per_s": 100.0}, 8: {"tokens_per_s": 180.0}},
                   {"1": {"tokens_per_s": 100.0}, "8": {"tokens_per_s": 180.0}}):
        table = report_module.readme_table({**REPORT, "server": {"levels": levels}})
        assert "concurrency 1 / 8: 100.0 / 180.0 tok/s" in table
