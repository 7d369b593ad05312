"""A full disk (issue 57 item 3): refused before the sweep starts with the space it needs, stopped at the first sign
with one paragraph, its state written whole, resumable once space is freed. A small tmpfs where this process may
mount one (root), a fake file system otherwise."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs
import pytest

from pipelines import mlflow_layout
from pipelines.run import disk
from pipelines.run import state as states
from tests.pipelines.sweep_cli import GATED, REPO, read_until, spawn_sweep

from .conftest import assert_clean_error

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def tmpfs():
    """Mount a tmpfs of the given size (bytes) at a fresh folder; unmounted afterwards. Skips where mounting is not
    allowed (not root, or no mount(8))."""
    mounted = []

    def mount(size: int) -> Path:
        where = Path(tempfile.mkdtemp(prefix="pp-tmpfs-"))
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            where.rmdir()
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def _fill(where: Path, leave: int) -> Path:
    """A file filling ``where``'s file system up to ``leave`` free bytes."""
    filler = where / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(disk.free_bytes(where) - leave, 0))
    return filler


def test_a_sweep_without_the_space_it_needs_is_refused_before_ray_starts(scratch, tmp_path, run_main, monkeypatch):
    """A fake statvfs: 10 MB free where the sweep writes. One paragraph with the number needed, exit 2, no Ray."""
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: Usage(10 ** 9, 10 ** 9 - 10 ** 7, 10 ** 7))
    proc, _ = run_main("--config", str(scratch()))
    need = disk.needed_bytes(4, 2)  # limit 4 x 1 task, the baseline and one trial
    assert_clean_error(proc, f"not enough disk space: the sweep needs about {need / 1e6:,.0f} MB free at ",
                       "and it has 10 MB. Free space there")
    assert not list((tmp_path / "outputs" / "tune" / states.STATE_DIR).glob("*.json"))  # no run began


def test_tune_files_are_written_whole_or_not_at_all(tmpfs, tmp_path):
    """`AtomicLocalFiles`, as Tune writes through it (pyarrow's copy_files): a file too large for the disk fails
    with ENOSPC and leaves the previous version whole, and no partial file behind."""
    where = tmpfs(1 << 20)
    files = pyarrow.fs.PyFileSystem(disk.AtomicLocalFiles())
    with files.open_output_stream(str(where / "experiment_state.json")) as f:
        f.write(b'{"sampled": 1}')
    big = tmp_path / "big"
    big.write_bytes(os.urandom(2 << 20))
    with pytest.raises(OSError) as raised:
        pyarrow.fs.copy_files(str(big), str(where / "experiment_state.json"), destination_filesystem=files)
    assert disk.is_disk_full(raised.value)
    assert json.loads((where / "experiment_state.json").read_text()) == {"sampled": 1}
    assert sorted(os.listdir(where)) == ["experiment_state.json"]


def test_a_write_cut_short_leaves_the_old_file_on_any_machine(tmp_path, monkeypatch):
    """The same without a tmpfs: a file whose writes fail with ENOSPC after 8 bytes."""
    real_open = open

    class Filling:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 8:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    (tmp_path / "tuner.pkl").write_bytes(b"old")
    monkeypatch.setattr(disk, "open", lambda path, mode: Filling(real_open(path, mode)), raising=False)
    files = pyarrow.fs.PyFileSystem(disk.AtomicLocalFiles())
    with pytest.raises(OSError, match="No space left"):
        with files.open_output_stream(str(tmp_path / "tuner.pkl")) as f:
            f.write(b"a new state that does not fit")
    assert (tmp_path / "tuner.pkl").read_bytes() == b"old" and os.listdir(tmp_path) == ["tuner.pkl"]


def test_the_runs_state_survives_a_full_disk(tmpfs):
    """`state.save_state` on a full disk raises and leaves the state it wrote before (it was cut at 4096 bytes)."""
    where = tmpfs(1 << 20)
    good = {"experiment": "rel-20261125-090000", "parent_run_id": "r0", "storage_path": str(where)}
    states.save_state(str(where), good)
    _fill(where, 1024)
    with pytest.raises(OSError):
        states.save_state(str(where), {**good, "spec_yaml": "x" * 100_000})
    assert states.load_state(str(where), "rel", "latest") == good
    assert not [p for p in (where / states.STATE_DIR).iterdir() if p.name.endswith(".part")]


def test_the_watch_stops_below_its_reserve_and_forgets_it_when_pickled(tmpfs, monkeypatch):
    """`DiskWatch` stops the experiment when a watched file system runs low, and a watch restored from Tune's pickle
    (`--resume`) starts unstopped."""
    import pickle
    import signal

    # outside Tune's fit: Tune never takes back the SIGUSR1 handler it installs, so an earlier in-process Tune run of
    # this test session would leave one of its own here
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    where = tmpfs(disk.RESERVE_BYTES + (8 << 20))
    watch = disk.DiskWatch("rel-watch", [str(where)])
    watch.on_step_begin(0, [])
    assert not watch.stop_all() and disk.tripped("rel-watch") is None
    filler = _fill(where, disk.RESERVE_BYTES - (1 << 20))
    watch._look(force=True)  # outside Tune's fit (no handler of Tune's to signal): its stopper stops the experiment
    assert watch.stop_all() and watch("t", {}) and f"{where} has " in disk.tripped("rel-watch")
    restored = pickle.loads(pickle.dumps(watch))
    disk._TRIPPED.clear()  # a new driver process
    filler.unlink()
    assert not restored.stop_all()


def test_a_storage_that_refuses_writes_stops_the_sweep_at_the_first_failure(tmpfs, tmp_path, monkeypatch):
    """The probe's case: Tune's storage made unwritable mid-sweep (an immutable flag, a remount read-only) failed
    every trial after its retries, exit 1, no resume line. Now a trial's first failure on a write the storage refuses
    stops the sweep as a full disk does, with a paragraph naming the path, the cause and the resume command (not a
    full disk's "free space"). A permission error about something the sweep does not write to (its places take a
    test write) leaves the sweep going."""
    import signal

    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)  # outside Tune's fit (as above)
    where = tmpfs(disk.RESERVE_BYTES + (8 << 20))
    (where / "tune").mkdir()
    error = tmp_path / "error.txt"
    trial = SimpleNamespace(error_file=str(error))
    error.write_text("PermissionError: [Errno 13] Permission denied: '/etc/promprune-model/weights.bin'")
    watch = disk.DiskWatch("rel-unwritable", [str(where / "tune")])
    watch.on_trial_error(0, [], trial)  # writable storage: not the storage's refusal
    assert not watch.stop_all() and disk.tripped("rel-unwritable") is None

    blocks = where / "tune" / "_promprune_blocks"
    error.write_text(f"PermissionError: [Errno 30] Cannot create directory '{blocks}'. Detail: [errno 30] Read-only "
                     "file system")
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    try:
        watch.on_trial_recover(0, [], trial)  # the first failure, before Tune retries it
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(where)], check=True)
    assert watch.stop_all() and disk.tripped_cause("rel-unwritable") == disk.UNWRITABLE
    why = disk.tripped("rel-unwritable")
    assert f"failed writing to {blocks}: Read-only file system" in why
    said = disk.full_message(why, "python pipelines/sweep.py --config s.yaml --resume r-1", disk.UNWRITABLE)
    assert said.startswith("storage not writable: ") and "Make that path writable again" in said
    assert "disk full" not in said and "Free space" not in said
    assert said.endswith("finish it with:\n  python pipelines/sweep.py --config s.yaml --resume r-1")
    assert disk.full_message("x", "r").startswith("disk full: x.")  # a full disk's paragraph as it was
    disk._TRIPPED.clear()


def test_a_write_refusal_names_the_place_that_refuses(tmpfs):
    """`unwritable_place` names a path quoted in the error under a watched place (or the place), by a test write;
    None while every place takes one."""
    where = tmpfs(1 << 20)
    (where / "tune").mkdir()
    text = f"[Errno 1] Operation not permitted: '{where / 'tune' / 'x' / 'y.parquet'}'"
    assert disk.is_unwritable(PermissionError(text)) and not disk.is_disk_full(PermissionError(text))
    assert disk.unwritable_place([str(where / "tune")], text) is None
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    try:
        found = disk.unwritable_place([str(where / "tune"), "sqlite:///" + str(where / "mlflow.db")], text)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(where)], check=True)
    assert found == (str(where / "tune" / "x" / "y.parquet"), "Read-only file system")
    assert not list(where.rglob(".promprune-write-test*"))


SWEEP = """
name: full
version: 1
model: {pretrained: "tiny:llava"}
tasks: [easyvqa_yesno]
limit: 8
grid: {method: [promprune, gated], budget: [8, 4]}
plugins: [gated.py]
generation: {max_new_tokens: 2}
"""


@pytest.mark.long  # the long tier (pyproject's markers): two real sweeps; in CI run the refusal, the watch, the whole
# writes (above) and a killed sweep's resume (tests/pipelines/test_engine.py)
def test_a_disk_filled_mid_sweep_stops_it_and_resume_finishes_it(tmpfs, tmp_path, monkeypatch):
    """The issue's scenario with a real sweep (local Ray, a real MLflow store): Tune's storage on a small tmpfs,
    filled after the first trial finishes, while the `gated` trials are held (with warm workers the tiny sweep would
    otherwise finish before the watch looks). The sweep stops with one paragraph (exit 2, no traceback, no trial
    retried for minutes); once the filler is removed `--resume` finishes it: one FINISHED run per trial, each with
    its scores."""
    storage = tmpfs(disk.RESERVE_BYTES + (32 << 20)) / "tune"
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    gate = tmp_path / "gate"
    (tmp_path / "gated.py").write_text(textwrap.dedent(GATED.format(gate=str(gate))))
    spec = tmp_path / "full.yaml"
    spec.write_text(SWEEP + f"tune: {{storage_path: {storage}}}\n")
    try:
        first = spawn_sweep(spec, tmp_path)
        read_until(first, "[1/5]", timeout=600)
        filler = _fill(storage.parent, 1 << 20)
        out, _ = first.communicate(timeout=600)
        assert first.returncode == 2, out[-4000:]
        assert "error: disk full: " in out and "Traceback" not in out, out[-4000:]
        # the sweep runs in tmp_path, outside the checkout: its resume command names the script as reached from there
        # (after the variables the run depended on, set in front of it: this test's MLflow store)
        said = out.split("finish it with:\n  ", 1)[1].split("\n")[0]
        assert f" python {REPO / 'pipelines' / 'sweep.py'} --config" in f" {said}", out[-4000:]
        filler.unlink()
        gate.touch()
        second = spawn_sweep(spec, tmp_path, "--resume")
        out, _ = second.communicate(timeout=900)
        assert second.returncode == 0, out[-4000:]
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = c.get_experiment_by_name(mlflow_layout.DEFAULT_EXPERIMENT).experiment_id
    (parent,) = c.search_runs([exp], filter_string="tags.`promprune.role` = 'sweep'")
    assert parent.info.status == "FINISHED"
    runs = c.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    finished = [r for r in runs if r.info.status == "FINISHED"]
    ids = sorted(r.data.tags[mlflow_layout.TRIAL] for r in finished)
    assert ids == sorted(["baseline", "promprune-b8", "promprune-b4", "gated-b8", "gated-b4"]), ids
    assert all("easyvqa_yesno/f1" in r.data.metrics for r in finished)  # (tiny:llava scores 0: no Rel. to divide)
