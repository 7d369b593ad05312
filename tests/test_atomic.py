"""promprune.atomic.atomic_path: the target is the old one or the whole new one, never half, for files and
directories, and a failed writer leaves nothing behind."""
from __future__ import annotations

import pytest

from promprune.atomic import atomic_path


def test_a_file_appears_whole_and_replaces_the_old_one(tmp_path):
    target = tmp_path / "sub" / "data.json"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and not tmp.exists() and not target.exists()
        tmp.write_text("one")
        assert not target.exists()  # nothing at the target until the block ends
    assert target.read_text() == "one"
    with atomic_path(target) as tmp:
        tmp.write_text("two")
        assert target.read_text() == "one"
    assert target.read_text() == "two" and sorted(p.name for p in target.parent.iterdir()) == ["data.json"]


def test_a_failed_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "data.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["data.json"]


def test_a_directory_replaces_an_incomplete_one(tmp_path):
    target = tmp_path / "checkpoint"
    target.mkdir()
    (target / "partial.bin").write_text("x")
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in target.iterdir()] == ["config.json"] and [p.name for p in tmp_path.iterdir()] == [
        "checkpoint"]
    with pytest.raises(ValueError):
        with atomic_path(target) as tmp:
            (tmp / "deep").mkdir(parents=True)
            raise ValueError
    assert [p.name for p in target.iterdir()] == ["config.json"] and len(list(tmp_path.iterdir())) == 1


def test_two_writers_get_different_temporaries(tmp_path):
    with atomic_path(tmp_path / "f") as a, atomic_path(tmp_path / "f") as b:
        assert a != b
        a.write_text("a")
        b.write_text("b")
    assert (tmp_path / "f").read_text() == "a"  # the outer block ends last and wins
