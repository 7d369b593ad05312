"""pipelines/timeline.py: events from several processes merged, saved, and summarized by hand-worked numbers."""
from __future__ import annotations

import csv
import json
import multiprocessing

import pytest

from pipelines import timeline


def _events():
    """A 10 s sweep: one actor ready at 3 s, busy 4.1..6.1 and 6.5..8.5 (4 s); one trial through every phase."""
    return [
        ("sweep_begin", "driver", 100.0, {}),
        ("actor_process", "actor", 101.2, {}), ("actor_ready", "actor", 103.0, {}),
        ("tune_start", "driver", 103.2, {}),
        ("trial_start", "driver", 103.5, {"trial": "a"}), ("trial_begin", "trial", 104.0, {"trial": "a"}),
        ("first_request", "trial", 104.0, {"trial": "a"}),
        ("predict_start", "actor", 104.1, {"call": "m/8"}), ("predict_end", "actor", 106.1, {"call": "m/8"}),
        ("predict_start", "actor", 106.5, {"call": "m/8"}), ("predict_end", "actor", 108.5, {"call": "m/8"}),
        ("last_answer", "trial", 108.6, {"trial": "a"}), ("trial_scored", "trial", 109.0, {"trial": "a"}),
        ("trial_reported", "trial", 109.2, {"trial": "a"}), ("trial_recorded", "driver", 109.5, {"trial": "a"}),
        ("sweep_end", "driver", 110.0, {}),
    ]


def _write_from_child(folder, events):
    import os

    os.environ[timeline.ENV] = str(folder)
    for name, where, t, fields in events:
        timeline.mark(name, where, t=t, **fields)


def test_off_by_default_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.mark("sweep_begin", "driver")
    assert not timeline.enabled() and list(tmp_path.iterdir()) == []


def test_processes_merge_in_time_order_and_the_summary_is_hand_worked(tmp_path, monkeypatch):
    events = _events()
    actor = [e for e in events if e[1] == "actor"]
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_write_from_child, args=(tmp_path, actor))  # the actor: another process, its own file
    child.start(), child.join()
    assert child.exitcode == 0
    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    timeline.tag(node="n1")
    try:
        for name, where, t, fields in events:
            if where != "actor":
                timeline.mark(name, where, t=t, **fields)
    finally:
        timeline.tag(node=None)
    assert len(list(tmp_path.glob("*.jsonl"))) == 2
    got = timeline.read(tmp_path)
    assert [e["event"] for e in got] == [e[0] for e in sorted(events, key=lambda e: e[2])]
    assert {e["node"] for e in got if e["where"] == "driver"} == {"n1"}
    assert timeline.actor_busy(got) == {child.pid: pytest.approx(4.0)}
    lines = timeline.summary(got)
    assert lines[0].startswith("timeline: 10.0 s from sweep_begin to sweep_end")
    # busy 4 s of the 7 s the actor was alive after ready (103 -> 110); 4 of 10 actor-seconds since sweep_begin
    assert "busy 4.0 s of 7.0 s alive after ready (57%)" in lines[2] and "(40%)" in lines[2]
    assert ("trial_start->trial_begin 0.50, trial_begin->first_request 0.00, first_request->last_answer 4.60, "
            "last_answer->trial_scored 0.40") in lines[3]


def test_write_csv_and_json_with_seconds_since_each_runs_begin(tmp_path):
    events = [{"run": 8, "t": 50.0, "event": "sweep_begin", "where": "driver", "pid": 1},
              {"run": 8, "t": 52.5, "event": "actor_ready", "where": "actor", "pid": 2},
              {"run": 4, "t": 10.0, "event": "sweep_begin", "where": "driver", "pid": 3},
              {"run": 4, "t": 11.0, "event": "sweep_end", "where": "driver", "pid": 3}]
    timeline.write(events, tmp_path / "t.csv")
    timeline.write(events, tmp_path / "t.json")
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["s"]) for r in rows] == [0.0, 2.5, 0.0, 1.0]
    assert [e["s"] for e in json.loads((tmp_path / "t.json").read_text())] == [0.0, 2.5, 0.0, 1.0]
