"""A trial's saved blocks (`pipelines/run/checkpoints.py`): a block file that cannot be read back is set aside, not
a crash of `--resume`, and its samples count as not answered."""
from __future__ import annotations

import pyarrow as pa
import pytest

from pipelines.run import checkpoints
from pipelines.run.result import PREDICTION_SCHEMA


def _block(task: str, docs: range) -> pa.Table:
    """A block of predictions: one row per doc, every other column null."""
    columns = {f.name: pa.nulls(len(docs), f.type) for f in PREDICTION_SCHEMA}
    columns["task"] = pa.array([task] * len(docs), pa.string())
    columns["doc_id"] = pa.array(list(docs), pa.int64())
    columns["prediction"] = pa.array([f"answer {d}" for d in docs], pa.string())
    return pa.table(columns, schema=PREDICTION_SCHEMA)


@pytest.mark.parametrize("damage", ["cut", "empty", "garbled"])
def test_an_unreadable_block_is_set_aside_and_its_samples_count_as_unanswered(tmp_path, damage):
    """The probe's case: a saved block cut short (also: emptied, its middle overwritten) made `--resume` end in
    pyarrow's "Parquet magic bytes not found" traceback. Now the other blocks are read as saved, the damaged file is
    renamed `<name>.unreadable` with its bytes as they were, one line names it, and the trial's saved samples are
    those of the readable blocks (so the engine answers the others again). The sweep's clean-up keeps it."""
    sweep = str(tmp_path / checkpoints.BLOCKS_DIR / "rel-1")
    store = checkpoints.BlockStore(checkpoints.trial_dir(sweep, "baseline"))
    first, second, third = _block("t", range(0, 4)), _block("t", range(4, 8)), _block("t", range(8, 11))
    for name, table in [("a", first), ("b", second), ("c", third)]:
        store.save(name, table)
    damaged = tmp_path / checkpoints.BLOCKS_DIR / "rel-1" / "baseline" / "b.parquet"
    raw = damaged.read_bytes()
    bad = {"cut": raw[:100], "empty": b"", "garbled": raw[:4] + b"\0" * 200 + raw[204:]}[damage]
    damaged.write_bytes(bad)

    said: list[str] = []
    loaded = checkpoints.BlockStore(store.uri, say=said.append).load()
    assert loaded.sort_by("doc_id").to_pylist() == pa.concat_tables([first, third]).to_pylist()
    aside = damaged.with_name("b.parquet.unreadable")
    assert not damaged.exists() and aside.read_bytes() == bad
    assert len(said) == 1 and str(damaged) in said[0] and str(aside) in said[0], said
    assert "answered again" in said[0]

    again: list[str] = []  # set aside once: later reads skip it, silently
    assert checkpoints.BlockStore(store.uri, say=again.append).load().num_rows == 7 and again == []
    assert checkpoints.saved_samples(sweep, "baseline") == 7

    store.save("b", second)  # answered again: the trial's blocks are whole
    assert checkpoints.BlockStore(store.uri).load().sort_by("doc_id").to_pylist() == pa.concat_tables(
        [first, second, third]).to_pylist()

    checkpoints.remove(sweep)  # the sweep is in MLflow: its blocks go, the file set aside stays
    assert aside.read_bytes() == bad
    assert not list(aside.parent.glob("*.parquet"))


def test_a_second_unreadable_copy_does_not_replace_the_first(tmp_path):
    """A block set aside, answered again, then damaged again: both damaged files are kept."""
    store = checkpoints.BlockStore(str(tmp_path / "trial"))
    for round_ in (b"first damage", b"second damage"):
        store.save("a", _block("t", range(2)))
        (tmp_path / "trial" / "a.parquet").write_bytes(round_)
        assert checkpoints.BlockStore(store.uri, say=lambda line: None).load().num_rows == 0
    assert (tmp_path / "trial" / "a.parquet.unreadable").read_bytes() == b"first damage"
    assert (tmp_path / "trial" / "a.parquet.1.unreadable").read_bytes() == b"second damage"


def test_a_sweep_without_unreadable_blocks_is_removed_whole(tmp_path):
    sweep = str(tmp_path / "blocks" / "rel-1")
    checkpoints.BlockStore(checkpoints.trial_dir(sweep, "x")).save("a", _block("t", range(2)))
    checkpoints.remove(sweep)
    assert not (tmp_path / "blocks" / "rel-1").exists()


def test_a_scoring_failure_is_noted_for_its_session_only(tmp_path):
    """A trial's note of its deterministic scoring error (`BlockStore.note_failure`): read back in the session that
    wrote it (a Tune retry raises it at once), not in another (a `--resume` scores again), not counted as a block;
    the sweep's clean-up removes it with the blocks."""
    sweep = str(tmp_path / checkpoints.BLOCKS_DIR / "rel-1")
    store = checkpoints.BlockStore(checkpoints.trial_dir(sweep, "promprune-b8"))
    assert store.failure("s1") is None
    store.note_failure("s1", "task 'own': its process_results raised ValueError: no grade")
    assert store.failure("s1") == "task 'own': its process_results raised ValueError: no grade"
    assert store.failure("s2") is None and store.load().num_rows == 0
    store.save("a", _block("t", range(0, 2)))
    assert checkpoints.saved_samples(sweep, "promprune-b8") == 2
    store.note_failure("s2", "again")  # the resumed session's own failure replaces the note
    assert store.failure("s1") is None and store.failure("s2") == "again"
    checkpoints.remove(sweep)
    assert not (tmp_path / checkpoints.BLOCKS_DIR / "rel-1").exists()
