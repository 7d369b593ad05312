"""The once-only training cache of promprune.training.common: the file lock (filelock) and the atomic directory."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path


from promprune.training.common import complete, locked, train_once


class Saved:
    """Stands in for a model or processor: ``save_pretrained`` writes what :func:`complete` looks for, slowly."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, directory):
        directory.mkdir(parents=True, exist_ok=True)
        time.sleep(0.05)
        (directory / self.name).write_text("x")


_TRY_LOCK = """
import sys
from filelock import Timeout
from promprune.training.common import locked
try:
    with locked(__import__("pathlib").Path(sys.argv[1])).acquire(timeout=0.2):
        print("acquired")
except Timeout:
    print("timeout")
"""


def _other_process_tries(path) -> str:
    out = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_lock_excludes_another_process(tmp_path):
    """What the lock is for: a second process (another trial, another test worker) waits while one trains."""
    path = tmp_path / "deep" / ".model.lock"
    with locked(path):
        assert _other_process_tries(path) == "timeout"
    assert _other_process_tries(path) == "acquired"


def test_concurrent_callers_train_once_and_see_a_whole_checkpoint(tmp_path):
    target, calls = tmp_path / "model-v1", []

    def train():
        calls.append(1)
        time.sleep(0.2)
        return Saved("model.safetensors"), Saved("config.json")

    threads = [threading.Thread(target=train_once, args=(target, train, "a test model")) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and complete(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model-v1.lock", "model-v1"]  # no temporary left


def test_an_incomplete_leftover_is_replaced(tmp_path):
    target = tmp_path / "model-v1"
    target.mkdir()
    (target / "config.json").write_text("half")  # a killed run: no weights
    train_once(target, lambda: (Saved("model.safetensors"), Saved("config.json")), "a test model")
    assert complete(target) and (target / "config.json").read_text() == "x"


def test_a_caller_that_waits_for_another_training_says_so_at_once(tmp_path, caplog):
    """Two sweeps of tiny-easyvqa:llava started at once on a fresh cache: the second waited on the lock for the
    whole training (3 minutes on 2 idle cores, 45 under load) without a line. It now says at once whom it waits for,
    then loads what the other saved."""
    target = tmp_path / "model-v1"
    other = locked(tmp_path / ".model-v1.lock")  # another process training (this test holds its lock)
    other.acquire()
    calls = []
    waiter = threading.Thread(target=train_once, args=(target, lambda: calls.append(1), "a test model"), daemon=True)
    with caplog.at_level("WARNING", logger="promprune.training.common"):
        try:
            waiter.start()
            deadline = time.monotonic() + 10
            while "being trained by another process" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "a test model is being trained by another process" in caplog.text
            assert str(tmp_path / ".model-v1.lock") in caplog.text and waiter.is_alive()
        finally:
            for saved in (Saved("model.safetensors"), Saved("config.json")):  # the other process's checkpoint lands
                saved.save_pretrained(target)
            other.release()
            waiter.join(30)
    assert not waiter.is_alive() and calls == []  # loaded, not trained again
    assert "not found: training" not in caplog.text
