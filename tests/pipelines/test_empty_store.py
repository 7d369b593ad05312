"""A new SQLite store copied from MLflow's empty schema (`pipelines.recording.empty_store`) is the store MLflow makes
itself: the same tables, indexes and constraints at the same head revision, opened by MLflow with its Default
experiment under the new store's artifact root. Pinned against stores MLflow makes with no copy."""
import re
import sqlite3

import pytest
from mlflow.tracking import MlflowClient

from pipelines.recording import empty_store, tracking


def schema(path) -> tuple[set, list]:
    """(every table's, index's and trigger's definition, one clause per line, order-free; the Alembic revision).
    MLflow's own migrations rebuild some tables with their CHECK constraints in set order, which varies between
    processes, so two stores MLflow makes can list a table's constraints in different orders."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
        revision = db.execute("SELECT version_num FROM alembic_version").fetchall()
    clauses = {(kind, name, table, frozenset(re.split(r",\s*\n", sql or ""))) for kind, name, table, sql in rows}
    return clauses, revision


def experiments(uri: str) -> list[tuple]:
    return [(e.experiment_id, e.name, e.lifecycle_stage, e.artifact_location)
            for e in MlflowClient(uri).search_experiments()]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPRUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(empty_store.ENV, raising=False)
    return tmp_path / "cache"


def test_a_copied_store_is_the_store_mlflow_makes(cache, tmp_path, monkeypatch):
    made, copied = tmp_path / "made", tmp_path / "copied"
    made.mkdir(), copied.mkdir()
    assert empty_store.seed(copied / "mlflow.db")
    assert list(cache.glob("mlflow-empty-*.db")) == [empty_store.template()]  # made once, under its key
    # MLflow puts the Default experiment under the working directory's mlruns (absolute URIs: MLflow caches a store
    # per URI for the process)
    monkeypatch.chdir(made)
    reference = experiments(f"sqlite:///{made / 'mlflow.db'}")  # MLflow makes this one: its migrations
    monkeypatch.chdir(copied)
    seeded = experiments(f"sqlite:///{copied / 'mlflow.db'}")
    assert schema(copied / "mlflow.db") == schema(made / "mlflow.db")
    assert schema(made / "mlflow.db")[1]  # a head revision, not an empty table
    assert [e[:3] for e in seeded] == [e[:3] for e in reference] == [("0", "Default", "active")]
    assert seeded[0][3] == str(copied / "mlruns" / "0")  # its own artifact root, not the template's
    assert reference[0][3] == str(made / "mlruns" / "0")


def test_the_sweeps_client_seeds_a_new_store_and_writes_to_it(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'sweep.db'}")
    client = tracking.client()
    run = client.create_run(tracking.experiment_id(client), run_name="r")
    client.log_metric(run.info.run_id, "rel", 0.5)
    assert empty_store.template().exists()
    assert MlflowClient(f"sqlite:///{tmp_path / 'sweep.db'}").get_run(run.info.run_id).data.metrics == {"rel": 0.5}


def test_an_existing_store_is_never_touched(cache, tmp_path):
    database = tmp_path / "mlflow.db"
    database.write_bytes(b"not replaced")
    assert not empty_store.seed(database)
    assert database.read_bytes() == b"not replaced"


def test_without_the_copy_mlflow_makes_the_store(cache, tmp_path, monkeypatch):
    """Turned off, or with a cache that cannot be written: no copy, nothing raised; MLflow makes the store."""
    monkeypatch.setenv(empty_store.ENV, "0")
    assert not empty_store.seed(tmp_path / "off.db")
    monkeypatch.delenv(empty_store.ENV)
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the cache folder should be")
    assert not empty_store.seed(tmp_path / "unwritable.db")
    assert not (tmp_path / "off.db").exists() and not (tmp_path / "unwritable.db").exists()
    assert [e[1] for e in experiments(f"sqlite:///{tmp_path / 'unwritable.db'}")] == ["Default"]


def test_the_template_follows_mlflows_release(monkeypatch):
    import mlflow

    before = empty_store.key()
    monkeypatch.setattr(mlflow, "__version__", mlflow.__version__ + ".post1")
    assert empty_store.key() != before
