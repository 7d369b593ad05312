"""The driver's MLflow writes (pipelines/recording/outbox.py) against a real `mlflow server` that is stopped and started
again: nothing is lost or written twice, the console is told at once, the writes wait on disk for a later driver."""
from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from pipelines import mlflow_layout
from pipelines.recording.outbox import Outbox
from tests.pipelines.mlflow_server import MlflowServer


@pytest.fixture(scope="module")
def _module_server(tmp_path_factory):
    """One server for the module (a start costs ~15 s on 2 cores); each test works in an experiment of its own."""
    with MlflowServer(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture
def server(_module_server, monkeypatch):
    """The module's server, up (a test that stopped it and failed before starting it again left it down)."""
    if _module_server.proc is None:
        _module_server.start()
    monkeypatch.setenv(mlflow_layout.TRACKING_URI_ENV, _module_server.uri)
    return _module_server


def _create(box: Outbox, exp: str, key: str) -> None:
    box.submit("create", key, experiment_id=exp, name=key, tags={mlflow_layout.TRIAL: key}, params={"budget": 8},
               start_ms=int(time.time() * 1000))


def test_writes_survive_a_store_that_goes_down_and_comes_back(server, tmp_path):
    c = MlflowClient(server.uri)
    exp = c.create_experiment("outbox")
    said = []
    box = Outbox(c, tmp_path / "outbox", said.append, retry_s=1.0)
    _create(box, exp, "t1")
    box.submit("metrics", "t1", metrics={"samples/done": 8}, step=8)
    assert box.flush(60) == []
    run_id = box.run_id("t1")
    assert c.get_run(run_id).info.status == "RUNNING"

    server.stop()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "predictions.parquet")
    box.submit("metrics", "t1", metrics={"samples/done": 16, "a/acc": 0.5}, step=16)
    box.submit("artifact", "t1", path=str(tmp_path / "predictions.parquet"))
    (tmp_path / "predictions.parquet").unlink()  # the caller's file may go: the outbox kept a copy
    box.submit("end", "t1", status="FINISHED", end_ms=int(time.time() * 1000))
    t0 = time.monotonic()
    while not said and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert said and "does not answer" in said[0] and str(tmp_path / "outbox") in said[0]
    assert time.monotonic() - t0 < 15, "the console must hear of it within seconds"
    assert (tmp_path / "outbox" / "outbox.json").is_file()
    assert box.flush(2) == ["t1"]

    server.start()
    assert box.flush(120) == []
    assert not (tmp_path / "outbox" / "outbox.json").exists()  # the folder says what is pending: nothing now
    assert box.close() == []
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == {"samples/done": 16.0, "a/acc": 0.5}
    assert [m.step for m in c.get_metric_history(run_id, "samples/done")] == [8, 16]
    assert [a.path for a in c.list_artifacts(run_id)] == ["predictions.parquet"]
    assert any("answers again" in line for line in said)
    assert not (tmp_path / "outbox").exists()  # nothing left to send
    assert len(c.search_runs([exp])) == 1


def test_a_later_driver_sends_what_an_earlier_one_kept(server, tmp_path):
    c = MlflowClient(server.uri)
    exp = c.create_experiment("outbox-resume")
    server.stop()
    first = Outbox(c, tmp_path / "outbox", lambda _: None, retry_s=1.0)
    _create(first, exp, "t1")
    first.submit("end", "t1", status="KILLED")
    assert first.flush(3) == ["t1"]
    first.close()  # the driver ends with the store still down: the writes stay on disk
    assert (tmp_path / "outbox" / "outbox.json").is_file()

    server.start()
    said = []
    second = Outbox(MlflowClient(server.uri), tmp_path / "outbox", said.append, retry_s=1.0)
    assert second.flush(60) == []
    second.close()
    runs = c.search_runs([exp])
    assert len(runs) == 1 and runs[0].info.status == "KILLED" and runs[0].data.params == {"budget": "8"}
    assert "an earlier run kept" in said[0]


def test_a_create_whose_reply_was_lost_makes_one_run(server, tmp_path):
    """The same create applied twice (its first reply lost): the run is found by its unique tag, not made again."""
    c = MlflowClient(server.uri)
    exp = c.create_experiment("idempotent")
    box = Outbox(c, tmp_path / "outbox", lambda _: None)
    op = {"op": "create", "key": "t1", "experiment_id": exp, "name": "t1", "tags": {}, "params": {"a": 1},
          "uid": "fixed-uid"}
    first, again = box._create(op), box._create(op)
    box.close()
    assert first == again and len(c.search_runs([exp])) == 1


def test_a_refused_write_is_dropped_and_said_not_retried(server, tmp_path):
    c = MlflowClient(server.uri)
    exp = c.create_experiment("refused")
    said = []
    box = Outbox(c, tmp_path / "outbox", said.append, retry_s=1.0)
    _create(box, exp, "t1")
    box.submit("params", "t1", params={"budget": 16})  # a param changed: MLflow refuses it
    box.submit("metrics", "t1", metrics={"x": 1.0})
    assert box.flush(60) == []
    box.close()
    assert c.get_run(box.run_id("t1")).data.metrics == {"x": 1.0}
    assert any("refused and dropped" in line for line in said)


def test_a_write_for_a_run_not_created_yet_waits_for_it(tmp_path):
    """Issue 57: no write is dropped for want of its run. Ops of a key with no run wait (said once), every later op
    of that key behind them, while other runs' writes go; they land once a create of the key does, and `close`
    names what still waits. An untag of a tag the run lacks is done, not refused."""
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = c.create_experiment("waiting")
    said = []
    box = Outbox(c, tmp_path / "outbox", said.append, retry_s=1.0)
    box.submit("metrics", "late", metrics={"rel": 0.9})
    box.submit("end", "late", status="FINISHED")
    _create(box, exp, "other")
    box.submit("untag", "other", tag=mlflow_layout.INTERRUPTED)
    assert box.flush(3) == ["late"]  # waiting, not dropped
    assert c.get_run(box.run_id("other")).info.status == "RUNNING"  # the other run's writes went on
    assert [line for line in said if "late" in line] == [
        "[mlflow] writes for late wait for its run, which is not created yet (they go once it is)"]
    _create(box, exp, "late")
    assert box.flush(30) == []
    run = c.get_run(box.run_id("late"))
    assert run.data.metrics == {"rel": 0.9} and run.info.status == "FINISHED"  # in order: metrics, then the end
    assert not any("refused" in line for line in said)
    box.submit("tags", "never", tags={"a": 1})  # a run this driver never creates
    assert box.close() == ["never"]  # named as pending, and kept for the next driver, which may know the run
    assert (tmp_path / "outbox" / "outbox.json").is_file()


@pytest.mark.parametrize("damage", ["cut", "not_ops"])
def test_an_outbox_that_cannot_be_read_is_set_aside_whole_and_said(tmp_path, damage):
    """The probe's case: an outbox.json cut short ended `--resume` in json's JSONDecodeError, a traceback, the runs
    left RUNNING. Now its folder (the file and the copies of the files it uploads) is renamed
    `<folder>.unreadable` with its bytes as they were, one paragraph names the file and the folder set aside, and
    this driver's writes go as usual (its own outbox removed once empty; the folder set aside stays)."""
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = c.create_experiment("damaged")
    folder = tmp_path / "rel-1.outbox"
    whole = '{"ids": {"__parent__": "abc"}, "pending": [{"op": "end", "key": "t1", "status": "KILLED"}]}'
    bad = {"cut": whole[:40], "not_ops": '{"ids": {}, "pending": [["end", "t1"]]}'}[damage]
    (folder / "files" / "f1").mkdir(parents=True)
    (folder / "files" / "f1" / "predictions.parquet").write_bytes(b"kept predictions")
    (folder / "outbox.json").write_text(bad)
    said = []
    box = Outbox(c, folder, said.append, ids={"__parent__": "p"}, retry_s=1.0)
    aside = tmp_path / "rel-1.outbox.unreadable"
    assert (aside / "outbox.json").read_text() == bad
    assert (aside / "files" / "f1" / "predictions.parquet").read_bytes() == b"kept predictions"
    assert len(said) == 1 and str(folder / "outbox.json") in said[0] and str(aside) in said[0], said
    assert "cannot be read" in said[0] and "not in MLflow" in said[0]
    assert box.pending_ops() == [] and box.run_id("t1") is None and box.run_id("__parent__") == "p"
    _create(box, exp, "t2")
    box.submit("end", "t2", status="FINISHED")
    assert box.flush(30) == [] and box.close() == []
    assert c.get_run(box.run_id("t2")).info.status == "FINISHED"
    assert not folder.exists() and (aside / "outbox.json").read_text() == bad

    (folder).mkdir()  # damaged again later: the first folder set aside is not replaced
    (folder / "outbox.json").write_text("{")
    Outbox(c, folder, lambda _: None, retry_s=1.0).close()
    assert (aside / "outbox.json").read_text() == bad
    assert (tmp_path / "rel-1.outbox.unreadable-1" / "outbox.json").read_text() == "{"


class _Counting(Outbox):
    """An outbox that counts how often it saves itself whole."""

    def __init__(self, *args, **kwargs):
        self.saves = 0
        super().__init__(*args, **kwargs)

    def _save(self) -> None:
        self.saves += 1
        super()._save()


def test_a_write_kept_while_the_store_is_down_costs_one_line(tmp_path):
    """Nothing listens at the store's address. Each write submitted meanwhile is kept as one line appended to the
    journal beside outbox.json, and waits for the next try: the whole outbox was saved again for every write (and
    the store tried again at each one), time and bytes growing with the writes already kept: 4,000 writes (a block
    each) took 55 s of the driver's Tune loop and wrote 800 MB. A later driver gets every write once, in order, also
    when the driver died after saving the outbox whole and before removing the journal it took in."""
    client = MlflowClient("http://127.0.0.1:9")  # (the discard port: refused at once)
    folder = tmp_path / "outbox"
    box = _Counting(client, folder, lambda _: None, ids={"t1": "run-1"}, retry_s=3600)
    box.submit("metrics", "t1", metrics={"samples/done": 0}, step=0)
    deadline = time.monotonic() + 30
    while box.down_since is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert box.down_since is not None
    saves = box.saves
    for done in range(1, 301):
        box.submit("metrics", "t1", metrics={"samples/done": done}, step=done)
    assert box.saves == saves  # no write saved the whole outbox again
    assert len((folder / "outbox.jsonl").read_text().splitlines()) == 300

    def kept(outbox):  # (the driver killed: the first outbox is never closed)
        return [op["metrics"]["samples/done"] for op in outbox.pending_ops()]

    journal = (folder / "outbox.jsonl").read_bytes()
    later = Outbox(client, folder, lambda _: None, retry_s=3600)
    assert kept(later) == list(range(301))
    later.close()  # saved whole, the journal taken in ...
    assert not (folder / "outbox.jsonl").exists()
    (folder / "outbox.jsonl").write_bytes(journal + b'{"op": "metrics", "key": "t1", "metr')  # ... but still there
    third = Outbox(client, folder, lambda _: None, retry_s=3600)
    assert kept(third) == list(range(301))  # each once; the cut line (its write in flight) lost
    third.close()
    box.close()


def test_writes_sent_before_a_driver_was_killed_are_not_sent_again(tmp_path):
    """Reviewer's case: a driver killed after a batch went and outbox.json was saved without it, before the journal
    holding it was removed (or, in `_clear`, between removing outbox.json and the journal), left journal lines of
    writes already sent; the next driver sent them again, and an artifact's kept copy, removed once uploaded, then
    failed `log_artifact` as if the store were down: every later start said so and kept the outbox for good. Lines
    up to the last save's op are taken as in it or sent, and an artifact whose kept copy is gone as sent (said)."""
    c = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = c.create_run(c.create_experiment("sent")).info.run_id
    folder = tmp_path / "outbox"
    said = []
    box = Outbox(c, folder, said.append, ids={"t": run}, retry_s=1.0)
    (tmp_path / "a.txt").write_text("kept")
    box.submit("artifact", "t", path=str(tmp_path / "a.txt"))
    box.submit("metrics", "t", metrics={"m": 1.0}, step=0)
    assert box.flush(30) == []
    box.close()
    artifact_path = next(folder.glob("files/*/a.txt"), None)
    assert artifact_path is None  # its kept copy went with the upload
    kept = str(folder / "files" / "gone" / "a.txt")
    # what a killed driver left: outbox.json saved after the batch (nothing pending, seq 2), its journal still there
    folder.mkdir(exist_ok=True)
    (folder / "outbox.json").write_text(json.dumps({"ids": {"t": run}, "pending": [], "seq": 2}))
    (folder / "outbox.jsonl").write_text(
        json.dumps({"op": "artifact", "key": "t", "path": kept, "seq": 1}) + "\n"
        + json.dumps({"op": "metrics", "key": "t", "metrics": {"m": 1.0}, "step": 0, "ms": 1, "seq": 2}) + "\n"
        + json.dumps({"op": "tags", "key": "t", "tags": {"after": "yes"}, "seq": 3}) + "\n")
    later = Outbox(c, folder, said.append, ids={"t": run}, retry_s=1.0)
    assert [op["seq"] for op in later.pending_ops()] == [3]  # the lines after the save's op only
    assert later.flush(30) == [] and later.close() == []
    assert c.get_run(run).data.tags["after"] == "yes"
    assert len(c.get_metric_history(run, "m")) == 1 and not folder.joinpath("outbox.json").exists()

    # an artifact op whose kept copy is gone, pending in an outbox.json of older code (no seq): sent before, skipped
    folder.mkdir(exist_ok=True)
    (folder / "outbox.json").write_text(json.dumps({"ids": {"t": run}, "pending": [
        {"op": "artifact", "key": "t", "path": kept}, {"op": "tags", "key": "t", "tags": {"next": "1"}}]}))
    said.clear()
    third = Outbox(c, folder, said.append, ids={"t": run}, retry_s=1.0)
    assert third.flush(30) == [] and third.close() == []
    assert c.get_run(run).data.tags["next"] == "1"
    assert not any("does not answer" in line for line in said)
    assert any("was sent before (its kept copy is gone)" in line for line in said)
