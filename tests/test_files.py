import os

import pytest

from specserve.files import PARTIAL_SUFFIX, write_atomically, write_text_atomically


def test_a_file_is_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "table.json"
    write_text_atomically(path, "first")
    write_text_atomically(path, "second")
    assert path.read_text() == "second"

    def fails(partial):
        partial.write_text("half")
        assert partial.name == f"table.json.{os.getpid()}{PARTIAL_SUFFIX}"
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        write_atomically(path, fails)
    assert path.read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


def test_an_unwritable_place_raises_and_leaves_nothing(tmp_path):
    missing = tmp_path / "missing" / "table.json"
    with pytest.raises(OSError):
        write_text_atomically(missing, "x")
    assert not (tmp_path / "missing").exists()
