"""The paper's published numbers, shipped as data under `pipelines/paper_results/` (see its README.md).

One CSV per table of the paper, named after its spec (`table1_llava15.csv`; a spec that widens one,
`<name>_extended`, shows the paper's rows of `<name>.csv`: `published_name`), in the paper's layout: one row per
(method, budget, variant), one column per benchmark (lmms-eval task name, in the paper's unit), `rel` (percent)
or a logged metric key (`efficiency/prefill_tflops`), and `source` (where the row's numbers were read). An empty
cell is a number we could not find: the structure is shipped, the value is not invented.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

PAPER_DIR = Path(__file__).resolve().parents[1] / "paper_results"
KEY_COLUMNS = ("method", "budget", "variant")  # identify a row; `variant` is "" for a method's default options
META_COLUMNS = KEY_COLUMNS + ("source",)


EXTENDED = "_extended"  # a spec widening a table of the paper: `table6_efficiency_extended` widens `table6_efficiency`


def published_name(sweep_name: str, root: Path = PAPER_DIR) -> str | None:
    """The name of the CSV the published numbers of `sweep_name` are in: its own (`<sweep_name>.csv`), else, for a
    spec that widens a table of the paper (`<name>_extended`: the paper's methods and budgets among others), the
    table's (`<name>.csv`): the paper's rows, which the wider spec runs too; its other trials have no published row,
    so the report compares the paper's rows only. None when neither is shipped."""
    for name in dict.fromkeys((sweep_name, sweep_name.removesuffix(EXTENDED))):
        if (Path(root) / f"{name}.csv").is_file():
            return name
    return None


def load_published(sweep_name: str, root: Path = PAPER_DIR) -> pd.DataFrame | None:
    """The published table for `sweep_name` (`published_name`: a `<name>_extended` sweep's is `<name>`'s), or None
    when none is shipped.

    Returns one row per (method, budget, variant); value columns are floats (NaN where the paper's number was
    not found). Raises ValueError naming the file and column when the CSV is malformed.
    """
    name = published_name(sweep_name, root)
    if name is None:
        return None
    path = Path(root) / f"{name}.csv"
    frame = pd.read_csv(path, dtype={"method": str, "variant": str, "source": str}, keep_default_na=True)
    missing = [c for c in META_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; expected {list(META_COLUMNS)} + value columns")
    frame["variant"] = frame["variant"].fillna("")
    frame["source"] = frame["source"].fillna("")
    frame["budget"] = pd.to_numeric(frame["budget"], errors="coerce")
    for col in value_columns(frame):
        try:
            frame[col] = pd.to_numeric(frame[col], errors="raise")
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: column {col!r} has a non-numeric cell ({err})") from err
    return frame


def value_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if c not in META_COLUMNS]
