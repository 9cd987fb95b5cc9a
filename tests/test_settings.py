"""The SPECSERVE_* environment settings are checked when a command starts, each error naming its variable."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specserve.cli import app
from specserve.checks import ConfigError
from specserve.settings import check_environment


def test_unset_and_empty_settings_take_their_defaults():
    settings = check_environment({"PATH": "/bin", "SPECSERVE_GREEDY_SCREEN": ""})
    assert settings.SPECSERVE_KERNELS == "auto" and settings.SPECSERVE_GREEDY_SCREEN == "1"
    settings = check_environment({"SPECSERVE_TP_STEP_TIMEOUT": "2.5", "SPECSERVE_KERNELS": "scalar"})
    assert settings.SPECSERVE_TP_STEP_TIMEOUT == 2.5 and settings.SPECSERVE_KERNELS == "scalar"


@pytest.mark.parametrize("environ,needle", [
    ({"SPECSERVE_KERNELS": "fast"}, "SPECSERVE_KERNELS='fast'"),
    ({"SPECSERVE_GREEDY_SCREEN": "off"}, "SPECSERVE_GREEDY_SCREEN"),
    ({"SPECSERVE_TP_CONNECT_TIMEOUT": "-3"}, "SPECSERVE_TP_CONNECT_TIMEOUT"),
    ({"SPECSERVE_TP_STEP_TIMEOUT": "soon"}, "SPECSERVE_TP_STEP_TIMEOUT"),
    ({"SPECSERVE_KERNEL": "off"}, "unknown environment setting SPECSERVE_KERNEL"),
    ({"SPECSERVE_QUANT_ISA": "avx2"}, "unknown environment setting SPECSERVE_QUANT_ISA"),  # SPECSERVE_KERNELS picks it
    ({"SPECSERVE_LAYER_LOOP": "python"}, "unknown environment setting SPECSERVE_LAYER_LOOP"),  # one layer loop
])
def test_bad_settings_are_named(environ, needle):
    with pytest.raises(ConfigError, match=needle):
        check_environment(environ)


def test_a_command_with_a_bad_setting_stops_before_any_work(monkeypatch):
    monkeypatch.setenv("SPECSERVE_GREEDY_SCREEN", "off")
    result = CliRunner().invoke(app, ["generate", "def f():", "--max-tokens", "1"])
    assert result.exit_code == 2 and "SPECSERVE_GREEDY_SCREEN='off'" in result.output


def test_an_empty_cache_setting_is_the_default_cache(monkeypatch, tmp_path):
    from specserve.models.model_files import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SPECSERVE_CACHE", "")
    assert cache_root() == tmp_path / ".cache" / "specserve"
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "elsewhere"))
    assert cache_root() == tmp_path / "elsewhere" and cache_root().is_dir()
