"""A new SQLite MLflow store begins as a copy of MLflow's empty schema, made once per machine and MLflow release.

MLflow makes a new SQLite store by running its whole migration history (~100 Alembic revisions, one of them
reflecting and backfilling the trace tables): ~4 CPU-seconds on a 2-core machine, paid by every sweep that starts a
store, in the driver while Ray starts. The schema those migrations leave is a function of MLflow's release (its
migration scripts) and SQLAlchemy's, so it is made once, by MLflow itself (`_initialize_tables`, what
`SqlAlchemyStore` runs on an empty database), into ``<cache_dir>/mlflow-empty-<key>.db``, and each new store starts
as a copy of that file. MLflow then opens it as it opens any store it made: it checks the schema is at its head
revision and creates the Default experiment (the template has none: its artifact root is the new store's).

Anything unexpected (a read-only cache, an MLflow whose private `_initialize_tables` moved) leaves the store for
MLflow to make as before; ``PROMPRUNE_MLFLOW_TEMPLATE=0`` turns the copy off.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from promprune.env import cache_dir

ENV = "PROMPRUNE_MLFLOW_TEMPLATE"


def key() -> str:
    """What the empty schema depends on: MLflow's and SQLAlchemy's releases and the names of MLflow's migrations."""
    import mlflow
    import sqlalchemy

    versions = Path(mlflow.__file__).parent / "store" / "db_migrations" / "versions"
    names = sorted(p.name for p in versions.glob("*.py"))
    text = "|".join([mlflow.__version__, sqlalchemy.__version__, *names])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def template() -> Path:
    """The empty store for this MLflow (made now if this machine has none yet)."""
    target = cache_dir() / f"mlflow-empty-{key()}.db"
    if target.exists():
        return target
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    engine = sqlalchemy.create_engine(f"sqlite:///{part}")
    try:
        _initialize_tables(engine)
        os.replace(part, target)  # whole or absent: a process copying it never sees it half made
    finally:
        engine.dispose()
        part.unlink(missing_ok=True)  # a failed attempt leaves nothing behind
    return target


def seed(database: Path | None) -> bool:
    """Start the SQLite store at ``database`` (a ``sqlite:///`` path) as a copy of the empty schema when no store is
    there yet; False (MLflow makes it) when one is, for other stores, or when the copy cannot be made."""
    if database is None or database.exists() or os.environ.get(ENV, "1") == "0":
        return False
    try:
        source = template()
        part = database.with_name(f".{database.name}.{os.getpid()}.part")
        try:
            shutil.copyfile(source, part)
            os.link(part, database)  # never over a store another process made meanwhile
        except FileExistsError:
            return False
        finally:
            part.unlink(missing_ok=True)
        return True
    except Exception:  # noqa: BLE001 - MLflow makes the store itself, as it would without this
        return False
