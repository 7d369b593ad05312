"""The driver's MLflow writes, never lost and never blocking Tune: `Outbox`.

Every write of a sweep (a trial's run created when the trial starts, its progress as blocks come back, its final
metrics and predictions file, its end; the parent run's metrics and tags) is an *op* queued here and applied in
order by one background thread of the driver (SQLite's single writer), batched: the metrics queued for a run while
the thread was busy go in one ``log_batch``. A write that fails because the store does not answer is kept: the
pending ops (and the files they upload) are saved to the outbox folder beside the Tune experiment (``outbox.json``;
each write submitted after it, one line appended to ``outbox.jsonl``, `JOURNAL`), the console says at once that the
store does not answer, and the thread retries every `RETRY_S` while the sweep goes on. When the
store answers again the kept writes go, in order, and the folder is emptied once nothing is pending. `flush` waits
for the queue; `close` stops the thread and returns the runs whose writes are still pending (after any write in
flight has landed or failed), so the sweep says exactly which trials are not in MLflow yet; a later `--resume`
replays the outbox before anything else.

A run is named by a *key* (a trial id, or `PARENT`); the op that creates it records its MLflow run id, and later
ops of that key find it (``ids``: runs known beforehand, such as a resumed sweep's). No write is dropped for want of
its run: an op whose key has no run yet waits, with every later op of that key, until a create for the key lands,
while other runs' writes go on. Creating a run is idempotent: the run carries a tag with a unique id, looked up
before a retry creates it again (a create whose reply was lost must not make two runs).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Callable

from pipelines import mlflow_layout

PARENT = "__parent__"  # the key of the sweep's parent run
JOURNAL = "outbox.jsonl"  # beside outbox.json: the ops submitted since it was saved, one line each
RETRY_S = 5.0  # between attempts while the store does not answer
CREATE_KEY = "promprune.create_key"  # the tag that makes a create idempotent
# the MLflow client's own retries (minutes of backoff by default) would block the writer thread on a store that is
# down; the outbox retries instead, so one attempt with a short timeout says quickly that the store is unreachable
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
OPS = ("create", "metrics", "params", "tags", "untag", "artifact", "inputs", "end", "update")
# MLflow refusals of the op itself (not of the store: a param changed, a run deleted by hand): retrying cannot help,
# so the op is dropped and said
REFUSED = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
           "INVALID_STATE"}


class Outbox:
    """``Outbox(client, folder, say)``: ``submit`` ops, ``run_id(key)``, ``knows(key)``, ``flush(timeout_s)``,
    ``close()``.

    ``folder``: where pending writes are kept while the store does not answer (a local path; removed when empty).
    ``ids``: run ids already known (the parent's, trials' runs continued on resume)."""

    def __init__(self, client, folder: str | Path, say: Callable[[str], None], ids: dict | None = None,
                 retry_s: float = RETRY_S):
        for key, value in CLIENT_ENV.items():
            os.environ.setdefault(key, value)
        self.client, self.folder, self.say, self.retry_s = client, Path(folder), say, retry_s
        self.ids: dict[str, str] = dict(ids or {})
        self.queue: deque[dict] = deque()
        self.cond = threading.Condition()
        self.down_since: float | None = None  # the store stopped answering (None: it answers)
        self.on_disk = False  # outbox.json holds the pending ops (saved while the store was down, or at close)
        self.waiting: set[str] = set()  # keys whose writes wait for their run (said once each)
        self.busy = False
        self.closed = False
        self.seq = 0  # the ops' numbers, in the order submitted (the journal's lines name theirs)
        self._load()
        self.thread = threading.Thread(target=self._loop, name="mlflow-outbox", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------------------------
    # what the recorder calls

    def submit(self, op: str, key: str, **fields) -> None:
        """Queue one op: ``create`` (experiment_id, name, tags, params, start_ms), ``metrics`` (metrics, step),
        ``params``, ``tags``, ``untag`` (tag: removed if the run has it), ``artifact`` (path: copied into the
        outbox at once, the caller's file may go), ``inputs`` (datasets: [{name, digest, source, profile}]),
        ``end`` (status, end_ms), ``update`` (status)."""
        if op not in OPS:
            raise ValueError(f"unknown outbox op {op!r}; the ops are {', '.join(OPS)}")
        entry = {"op": op, "key": key, **fields}
        if op == "create":
            entry.setdefault("uid", uuid.uuid4().hex)
        if op == "artifact":
            entry["path"] = self._keep(Path(fields["path"]))
        if op == "metrics":
            entry["metrics"] = {k: float(v) for k, v in fields["metrics"].items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
            if not entry["metrics"]:
                return
            # stamped now, not when sent: a batch sent twice (its reply lost) is the same rows, which the store keeps
            # once
            entry.setdefault("ms", int(time.time() * 1000))
        with self.cond:
            self.seq += 1
            entry["seq"] = self.seq
            self.queue.append(entry)
            if self.down_since is not None:
                self._append(entry)
            self.cond.notify_all()

    def run_id(self, key: str) -> str | None:
        return self.ids.get(key)

    def knows(self, key: str) -> bool:
        """Whether ``key`` has a run, or a create of one is queued."""
        with self.cond:
            return key in self.ids or any(op["op"] == "create" and op["key"] == key for op in self.queue)

    def pending_ops(self) -> list[dict]:
        """The ops not yet in MLflow, in order (a copy)."""
        with self.cond:
            return list(self.queue)

    def pending_keys(self) -> list[str]:
        """Keys with writes not yet in MLflow, in the order they were queued."""
        with self.cond:
            return list(dict.fromkeys(op["key"] for op in self.queue))

    def flush(self, timeout_s: float) -> list[str]:
        """Wait until every queued write is in MLflow, or ``timeout_s`` has passed; the keys still pending (a
        write in flight at the deadline counts as pending: `close` says how it ended)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.cond.notify_all()
            while (self.queue or self.busy) and time.monotonic() < deadline:
                self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        return self.pending_keys()

    def close(self) -> list[str]:
        """Stop the thread once the write in flight, if any, has landed or failed (at most the client's timeout);
        the keys whose writes are still pending, which stay in the outbox folder for `--resume`."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", 30)) + 5)
        with self.cond:
            if self.queue:
                self._save()
            else:
                shutil.rmtree(self.folder, ignore_errors=True)
            return self.pending_keys()

    # ------------------------------------------------------------------------------------------------------------
    # the writer thread

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not any(self._sendable(op) for op in self.queue):
                    self.cond.wait()
                if self.closed:
                    return
                self.busy = True
                batch = list(self.queue)
            sent, error = [], None
            try:
                sent, error = self._apply(batch)
            finally:
                with self.cond:
                    gone = {id(op) for op in sent}
                    self.queue = deque(op for op in self.queue if id(op) not in gone)
                    self.busy = False
                    if error is None and self.on_disk:
                        self._save() if self.queue else self._clear()  # the folder says what is still pending
                    self.cond.notify_all()
            if error is not None:
                self._went_down(error)
                with self.cond:  # the next try after retry_s, not at each write submitted meanwhile (each one was
                    until = time.monotonic() + self.retry_s  # a try of the store, and the whole outbox saved again)
                    while not self.closed and time.monotonic() < until:
                        self.cond.wait(timeout=until - time.monotonic())
            else:
                self._answered()

    def _sendable(self, op: dict) -> bool:
        return op["op"] == "create" or op["key"] in self.ids

    def _apply(self, batch: list[dict]) -> tuple[list[dict], Exception | None]:
        """Apply ops in order: the ops done (applied, or refused by MLflow: dropped and said), and the error of a
        store that did not answer, which stopped them (the failed op is retried whole; the ops are idempotent). An
        op whose key has no run yet waits, with every later op of that key, for a create of the key."""
        done: list[dict] = []
        held: set[str] = set()
        creating = {op["key"] for op in batch if op["op"] == "create"}
        i = 0
        while i < len(batch):
            op, n = batch[i], 1
            if op["op"] != "create" and (op["key"] in held or op["key"] not in self.ids):
                held.add(op["key"])
                if op["key"] not in creating and op["key"] not in self.waiting:
                    self.waiting.add(op["key"])
                    self.say(f"[mlflow] writes for {op['key']} wait for its run, which is not created yet (they go "
                             "once it is)")
                i += 1
                continue
            if op["op"] == "metrics":  # the run's consecutive metric ops in one log_batch
                while i + n < len(batch) and batch[i + n]["op"] == "metrics" and batch[i + n]["key"] == op["key"]:
                    n += 1
            try:
                self._one(op, batch[i:i + n])
            except Exception as exc:  # noqa: BLE001 - the store's failures are many types; classified here
                if not _refused(exc):
                    return done, exc
                self.say(f"[mlflow] a write was refused and dropped ({op['op']} of {op['key']}): {_short(exc)}")
            done += batch[i:i + n]
            i += n
        return done, None

    def _one(self, op: dict, ops: list[dict]) -> None:
        c, kind = self.client, op["op"]
        if kind == "create":
            self.ids[op["key"]] = self._create(op)
            return
        run_id = self.ids[op["key"]]
        if kind == "metrics":
            from mlflow.entities import Metric

            batch = [Metric(k, v, int(o["ms"]), int(o.get("step", 0))) for o in ops for k, v in o["metrics"].items()]
            for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per call
                c.log_batch(run_id, metrics=batch[start:start + 1000])
        elif kind == "params":
            _log_params(c, run_id, op["params"])
        elif kind == "tags":
            from mlflow.entities import RunTag

            c.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in op["tags"].items()])
        elif kind == "untag":
            if op["tag"] in c.get_run(run_id).data.tags:  # (a retry after a lost reply finds it gone: done)
                c.delete_tag(run_id, op["tag"])
        elif kind == "artifact":
            if self.folder in Path(op["path"]).parents and not Path(op["path"]).is_file():
                # its kept copy goes once it is uploaded: an op sent before a driver was killed, read again from
                # the outbox's files (a window between a send and the files' update); retrying it would keep
                # the outbox "down" for good
                self.say(f"[mlflow] an artifact write for {op['key']} was sent before (its kept copy is gone): "
                         "not sent again")
                return
            c.log_artifact(run_id, op["path"], op.get("artifact_path"))
            _remove_kept(op["path"], self.folder)
        elif kind == "inputs":
            c.log_inputs(run_id, datasets=[_dataset_input(d) for d in op["datasets"]])
        elif kind == "end":
            c.set_terminated(run_id, status=op["status"], end_time=op.get("end_ms"))
        else:  # "update"
            c.update_run(run_id, status=op["status"])

    def _create(self, op: dict) -> str:
        """The run of a create op: the one an earlier attempt made (found by its unique tag), else a new one."""
        c = self.client
        found = c.search_runs([op["experiment_id"]], filter_string=mlflow_layout.tag_filter(CREATE_KEY, op["uid"]),
                              max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {**op["tags"], CREATE_KEY: op["uid"]}
            run_id = c.create_run(op["experiment_id"], run_name=op["name"], tags=tags,
                                  start_time=op.get("start_ms")).info.run_id
        if op.get("params"):  # (again after a lost reply: the same values are accepted)
            _log_params(c, run_id, op["params"])
        return run_id

    # ------------------------------------------------------------------------------------------------------------
    # down and up again, kept on disk

    def _went_down(self, exc: Exception) -> None:
        with self.cond:
            first = self.down_since is None
            if first:
                self.down_since = time.monotonic()
            self._save()
            n = len(self.queue)
        if first:
            self.say(f"[mlflow] the store at {mlflow_layout.tracking_uri()} does not answer ({_short(exc)}): {n} "
                     f"write(s) kept in {self.folder}, retried every {self.retry_s:g}s; the sweep goes on")

    def _answered(self) -> None:
        with self.cond:
            if self.down_since is None:
                return
            gone = time.monotonic() - self.down_since
            self.down_since = None
        self.say(f"[mlflow] the store answers again after {gone:.0f}s: the kept writes are going in")

    def _save(self) -> None:
        """The ids and the pending ops, atomically (called under the lock); the journal's ops are in it now."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".outbox.{uuid.uuid4().hex[:8]}.tmp"
        # seq: the last op submitted so far: each journal line up to it is in pending or was sent (`_load`)
        tmp.write_text(json.dumps({"ids": self.ids, "pending": list(self.queue), "seq": self.seq}))
        os.replace(tmp, self.folder / "outbox.json")
        (self.folder / JOURNAL).unlink(missing_ok=True)  # (a driver killed before this: `_load` skips its repeats)
        self.on_disk = True

    def _append(self, entry: dict) -> None:
        """One op submitted while the store does not answer, kept on disk as a line appended to the journal beside
        `outbox.json` (called under the lock): a write costs its own line, where saving the whole outbox for each
        one cost time and bytes growing with the writes kept (4,000 writes: 55 s and 800 MB written)."""
        if not self.on_disk:
            self._save()
            return
        with open(self.folder / JOURNAL, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _clear(self) -> None:
        (self.folder / JOURNAL).unlink(missing_ok=True)  # first: a journal left alone would be read as new ops
        (self.folder / "outbox.json").unlink(missing_ok=True)
        self.on_disk = False

    def _load(self) -> None:
        """Writes an earlier driver kept (the store did not answer before it ended): queued first, those of
        `outbox.json` and then the journal's (each op once: one in both was saved whole before its line was
        removed). A journal whose last line is cut short (the driver killed while appending it) loses that op."""
        path, journal = self.folder / "outbox.json", self.folder / JOURNAL
        if not path.is_file() and not journal.is_file():
            return
        saved, raw, where = {}, b"", path
        try:
            if path.is_file():
                raw = path.read_bytes()
                saved = json.loads(raw.decode())
                if not _well_formed(saved):
                    raise ValueError("not the outbox's {ids, pending} of ops")
            if journal.is_file():
                raw, where = journal.read_bytes(), journal
                lines = raw.decode().split("\n")
                appended = [json.loads(line) for line in lines[:-1] if line.strip()]  # (the last: cut, or "")
                if not _well_formed({"pending": appended}):
                    raise ValueError("not lines of outbox ops")
                # a line up to the save's seq is in its pending or was sent (a driver killed between the save
                # and the journal's removal): new are the lines after it
                last = saved.get("seq") if isinstance(saved.get("seq"), int) else 0
                have = {op.get("seq") for op in saved.get("pending", [])}
                saved = {**saved, "pending": [*saved.get("pending", []), *(
                    op for op in appended if op.get("seq") not in have
                    and not (isinstance(op.get("seq"), int) and op["seq"] <= last))]}
        except ValueError as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors) cut short or damaged
            self._set_aside(where, len(raw), exc)
            return
        self.ids = {**saved.get("ids", {}), **self.ids}
        self.queue.extend(saved.get("pending", []))
        self.seq = max((op["seq"] for op in self.queue if isinstance(op.get("seq"), int)),
                       default=0)
        if isinstance(saved.get("seq"), int):  # never below a save's: its journal lines are judged by it
            self.seq = max(self.seq, saved["seq"])
        self.on_disk = True
        if self.queue:
            self.say(f"[mlflow] {len(self.queue)} write(s) an earlier run kept in {self.folder} go in first")

    def _set_aside(self, path: Path, size: int, exc: Exception) -> None:
        """An outbox.json that cannot be read: its folder (with the copies of the files its writes upload) renamed
        ``<folder>.unreadable`` (``.unreadable-<n>`` if taken), never deleted, and one paragraph saying so; this
        driver starts with an empty outbox."""
        aside = self.folder.with_name(f"{self.folder.name}.unreadable")
        n = 1
        while aside.exists():
            aside, n = self.folder.with_name(f"{self.folder.name}.unreadable-{n}"), n + 1
        os.replace(self.folder, aside)
        self.say(f"[mlflow] note: the MLflow writes an earlier driver of this run kept for a store that did not "
                 f"answer ({path}, {size} bytes) cannot be read ({_short(exc)}: a write cut short or the file "
                 f"damaged). The folder is set aside as {aside}, kept as it was, and the sweep goes on without those "
                 "writes: a resumed sweep writes each trial's end again from Tune (a finished trial's final metrics "
                 "and predictions from its checkpoint), but the rest of what was kept there (trials' running scores "
                 "as their blocks came back, the driver's system metrics) is not in MLflow")

    def _keep(self, path: Path) -> str:
        """A copy of ``path`` in the outbox's files (its name kept: the artifact's name)."""
        dest = self.folder / "files" / uuid.uuid4().hex[:12] / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        return str(dest)


def _well_formed(saved) -> bool:
    """Whether ``saved`` (outbox.json read) is what `Outbox._save` writes: its ids, and its pending ops, each with
    an op and a key."""
    return (isinstance(saved, dict) and isinstance(saved.get("ids", {}), dict)
            and isinstance(saved.get("pending", []), list)
            and all(isinstance(op, dict) and op.get("op") in OPS and isinstance(op.get("key"), str)
                    for op in saved.get("pending", [])))


def _refused(exc: Exception) -> bool:
    """An op MLflow cannot take (dropped, said), as opposed to a store that does not answer (kept, retried)."""
    code = getattr(exc, "error_code", None)
    return isinstance(code, str) and code in REFUSED


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _log_params(client, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])


def _remove_kept(path: str, folder: Path) -> None:
    """Delete an uploaded file's copy (and its folder) from the outbox."""
    kept = Path(path)
    if folder in kept.parents:
        shutil.rmtree(kept.parent, ignore_errors=True)


def _dataset_input(d: dict):
    """An MLflow dataset input (name, digest, source, profile) used for evaluation."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(name=d["name"], digest=d["digest"], source_type=d.get("source_type", "lmms-eval"),
                      source=json.dumps(d.get("source", {})), profile=json.dumps(d.get("profile", {})))
    return DatasetInput(dataset=dataset, tags=[InputTag(key="mlflow.data.context", value="evaluation")])
