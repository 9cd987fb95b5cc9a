"""The target's step-cost tables (one row for drafting, the server's rows with the lm_head's share), kept in the
cache directory across starts."""

from __future__ import annotations

import json

from specserve.models import step_costs


def test_the_cached_table_keeps_only_the_most_recent_entries(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(step_costs, "_MEASURED", {})
    file = tmp_path / "verify_costs.json"
    old = {f"an older code version {i}": [1.0] * len(step_costs.StepCosts.SIZES) for i in range(40)}
    file.write_text(json.dumps(old))
    costs = step_costs.measured_step_costs(loaded("llama"))
    table = json.loads(file.read_text())
    assert len(table) == step_costs.TABLES_KEPT
    assert list(table.values())[-1]["seconds"] == costs.seconds  # the new entry, measured
    assert "an older code version 39" in table and "an older code version 0" not in table
    monkeypatch.setattr(step_costs, "_MEASURED", {})
    assert step_costs.measured_step_costs(loaded("llama")).seconds == costs.seconds  # read back, not measured
    assert len(json.loads(file.read_text())) == step_costs.TABLES_KEPT


def test_the_servers_table_of_many_rows_is_kept_with_its_lm_head_share(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(step_costs, "_MEASURED", {})
    target = loaded("llama")
    measured = step_costs.measured_step_costs(target, rows=4, lm_head=True)
    assert measured.head is not None and len(measured.head) == len(measured.seconds)
    one_row = step_costs.measured_step_costs(target)
    assert one_row is not measured and one_row.head is None  # another table: another key
    monkeypatch.setattr(step_costs, "_MEASURED", {})
    monkeypatch.setattr(step_costs.StepCosts, "forward_run", staticmethod(lambda *a: 1 / 0))  # no measuring
    again = step_costs.measured_step_costs(target, rows=4, lm_head=True)
    assert again.seconds == measured.seconds and again.head == measured.head
