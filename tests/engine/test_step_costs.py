"""The target's step-cost table, kept in the cache directory across starts."""

from __future__ import annotations

import json

from specserve.engine import step_costs


def test_the_cached_table_keeps_only_the_most_recent_entries(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(step_costs, "_VERIFY_COSTS", {})
    file = tmp_path / "verify_costs.json"
    old = {f"an older code version {i}": [1.0] * len(step_costs.StepCosts.SIZES) for i in range(40)}
    file.write_text(json.dumps(old))
    costs = step_costs.target_verify_seconds(loaded("llama"))
    table = json.loads(file.read_text())
    assert len(table) == step_costs.TABLES_KEPT
    assert list(table.values())[-1] == costs.seconds  # the new entry, measured
    assert "an older code version 39" in table and "an older code version 0" not in table
    monkeypatch.setattr(step_costs, "_VERIFY_COSTS", {})
    assert step_costs.target_verify_seconds(loaded("llama")).seconds == costs.seconds  # read back, not measured
    assert len(json.loads(file.read_text())) == step_costs.TABLES_KEPT
