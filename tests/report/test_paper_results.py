"""Every numeric cell of the paper's Tables 1-6 is shipped, as printed, in `pipelines/paper_results/*.csv`.

The paper's tables (`pipelines/paper_results/tables.tex`, extracted from its LaTeX source by scripts/paper_tables.py)
are parsed here on their own (no code shared with the pipeline): each table is found by its
`\\label`, its outer tabular is split into rows on `\\\\` and cells on `&`, and the markup is stripped. Each data
cell must appear in the matching CSV at the matching (row, column) as the same string (same decimals), and the CSV
must hold no value the table lacks. Group rows ("Retain 128 Tokens ↓77.8%") give the `budget` of the rows under
them; their other numbers (full token count, reduction) are checked for consistency, not shipped.
"""
from __future__ import annotations

import csv
import re

import pytest

from pipelines.reporting.published import PAPER_DIR, load_published

PAPER = PAPER_DIR / "tables.tex"  # the paper's tables as data (scripts/paper_tables.py extracts them from its source)
META = ("method", "budget", "variant", "source")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

# header text (lower case, letters and digits only) -> CSV column
COLUMNS = {
    "mme": "mme", "pope": "pope", "popef1": "pope", "mmbench": "mmbench_en_dev_static", "mmb": "mmbench_en_dev_static",
    "textvqa": "textvqa_val", "vqatext": "textvqa_val", "sqa": "scienceqa_img", "gqa": "gqa", "vqav2": "vqav2_val",
    "vizwiz": "vizwiz_vqa_val", "mmvet": "mmvet", "rel": "rel", "avg": "avg",
    "tokensbudget": "efficiency/visual_tokens", "flopst": "efficiency/prefill_tflops",
    "totalprefillmssample": "efficiency/prefill_ms", "kvcachemb": "efficiency/kv_cache_mb",
    "memorygb": "efficiency/peak_mem_gb",
}
LABEL_HEADERS = {"method", "strategy"}
# row label (same normalisation) -> (method, variant)
ROWS = {
    "llava157b": ("none", ""), "llavanext7b": ("none", ""), "qwen25vl7b": ("none", ""),
    "fastv": ("fastv", ""), "sparsevlm": ("sparsevlm", ""), "visionzip": ("visionzip", ""),
    "vispruner": ("vispruner", ""), "divprune": ("divprune", ""), "promprune": ("promprune", ""),
    "fixedallocation": ("fixed_ratio", "fixed"), "semanticprominenceaware": ("promprune", ""),
    "fps": ("promprune", "diversity=fps"), "fl": ("promprune", "diversity=facility_location"),
    "dpp": ("promprune", "diversity=dpp"),
}
# (label, CSV name, table number)
TABLES = [
    ("tab:main_llava-v15", "table1_llava15", 1),
    ("tab:llava_next", "table2_llava_next", 2),
    ("tab:qwen25vl", "table3_qwen25vl", 3),
    ("tab:budget", "table4_adaptive_vs_fixed", 4),
    ("tab:diversity_algorithms", "table5_diversity", 5),
    ("tab:efficiency_detailed", "table6_efficiency", 6),
]


def norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


@pytest.fixture(scope="module")
def tex() -> str:
    lines = PAPER.read_text(encoding="utf-8").splitlines()
    return "\n".join(re.sub(r"(?<!\\)%.*$", "", line) for line in lines)  # LaTeX comments


# ---------------------------------------------------------------------------------------------------------------
# LaTeX


def clean(cell: str) -> str:
    """A cell's text without markup: commands unwrapped innermost first, `$`, `\\%`, `~` and braces dropped."""
    s = cell.replace("\\%", "").replace("$", "")
    s = re.sub(r"~?\\cite\{[^{}]*\}", "", s)
    s = re.sub(r"\\(?:cellcolor|rowcolor)(?:\[[^\]]*\])?\{[^{}]*\}", "", s)
    wrappers = [
        r"\\(?:multicolumn|multirow)\{[^{}]*\}\{[^{}]*\}\{([^{}]*)\}",
        r"\\textcolor\{[^{}]*\}\{([^{}]*)\}",
        r"\\(?:textbf|underline|textit|emph|text|mathrm|mathbf)\{([^{}]*)\}",
    ]
    while True:
        before = s
        for pattern in wrappers:
            s = re.sub(pattern, r"\1", s)
        if s == before:
            break
    s = re.sub(r"\\[A-Za-z]+", " ", s)  # \downarrow, \scriptsize, ...
    s = s.replace("^", "").replace("{", "").replace("}", "").replace("~", " ")
    return re.sub(r"\s+", " ", s).strip()


def table_source(tex: str, label: str) -> tuple[str, str]:
    """(caption, body of the outer tabular) of the table labelled `label`."""
    at = tex.index(f"\\label{{{label}}}")
    caption_at = tex.rindex("\\caption{", 0, at)
    start = tex.index("\\begin{tabular}", at)
    depth = 0
    for m in re.finditer(r"\\(begin|end)\{tabular\}", tex[start:]):
        depth += 1 if m.group(1) == "begin" else -1
        if depth == 0:
            body = tex[start:start + m.start()]
            break
    else:
        raise AssertionError(f"{label}: unclosed tabular")
    body = re.sub(r"^\\begin\{tabular\}(?:\[[^\]]*\])?\{[^{}]*\}", "", body)
    inner = r"\\begin\{tabular\}(?:\[[^\]]*\])?\{(?:[^{}]|\{[^{}]*\})*\}(.*?)\\end\{tabular\}"
    body = re.sub(inner, lambda m: m.group(1).replace("\\\\", " "), body, flags=re.S)  # header cells of Table 6
    return tex[caption_at:at], body


def parse_table(tex: str, label: str) -> dict:
    """Header, group rows and data rows of one table, markup stripped."""
    caption, body = table_source(tex, label)
    rows = []
    for chunk in body.split("\\\\"):
        chunk = re.sub(r"\\(?:toprule|midrule|bottomrule|hline)|\\cline\{[^{}]*\}", "", chunk).strip()
        if chunk:
            rows.append([c.strip() for c in chunk.split("&")])
    header, rest = rows[0], rows[1:]
    columns, t_sal = [], {}
    for raw in header[1:]:
        text = clean(raw)
        m = re.fullmatch(r"(.*?)\s*\((\d+)\)", text)
        if m:  # Table 4: "MMBench(33)", the benchmark's average T_sal
            text = m.group(1)
        assert norm(text) in COLUMNS, f"{label}: header {text!r} has no CSV column"
        columns.append(COLUMNS[norm(text)])
        if m:
            t_sal[COLUMNS[norm(text)]] = m.group(2)
    assert norm(clean(header[0])) in LABEL_HEADERS, f"{label}: first header {header[0]!r}"
    assert len(set(columns)) == len(columns), f"{label}: two headers map to one column: {columns}"
    return {"caption": clean(caption), "columns": columns, "t_sal": t_sal,
            "rows": [[clean(c) for c in r] for r in rest]}


def expected_cells(tex: str, label: str, table_budget: str | None) -> tuple[list[str], dict]:
    """The CSV value columns and {(method, budget, variant): {column: printed number}} of one table."""
    t = parse_table(tex, label)
    cells: dict = {}
    budget, full = table_budget, None
    for row in t["rows"]:
        if len(row) == 1:  # a group row
            text = row[0]
            if m := re.fullmatch(r"Upper Bound, All (\d+) Tokens (\d+\.\d)", text):
                full, budget = int(m.group(1)), ""
                assert m.group(2) == "100.0", f"{label}: {text!r}"
            elif m := re.fullmatch(r"Retain (\d+) Tokens (\d+\.\d)", text):
                budget = m.group(1)
                assert full, f"{label}: {text!r} before the upper bound"
                assert m.group(2) == f"{100 * (1 - int(budget) / full):.1f}", f"{label}: reduction in {text!r}"
            else:
                raise AssertionError(f"{label}: a group row the test cannot place: {text!r}")
            continue
        assert len(row) == 1 + len(t["columns"]), f"{label}: {row}"
        name = norm(row[0])
        assert name in ROWS, f"{label}: row {row[0]!r} has no registry method"
        method, variant = ROWS[name]
        values = dict(zip(t["columns"], row[1:]))
        for col, value in values.items():
            assert NUMBER.fullmatch(value), f"{label}: row {row[0]!r}, column {col}: {value!r} is not a number"
        if method == "none":
            key_budget = ""
        elif "efficiency/visual_tokens" in values:  # Table 6: the Tokens (Budget) column is the budget
            key_budget = values["efficiency/visual_tokens"]
        else:
            key_budget = budget
        assert key_budget is not None, f"{label}: no budget for row {row[0]!r}"
        key = (method, key_budget, variant)
        assert key not in cells, f"{label}: two rows map to {key}"
        cells[key] = values
    if t["t_sal"]:  # Table 4's header: the adaptive method's mean T_sal per benchmark, on the promprune row
        adaptive = [k for k in cells if k[0] == "promprune"]
        assert len(adaptive) == 1, f"{label}: {adaptive}"
        cells[adaptive[0]].update({f"t_sal/{task}": v for task, v in t["t_sal"].items()})
    columns = t["columns"] + [f"t_sal/{task}" for task in t["t_sal"]]
    return columns, cells


def budget_of(tex: str, label: str) -> str | None:
    """A table's single budget where the table has no group rows: Table 4 states it in its caption; Table 5 does
    not, and its DPP row is Table 1's PromPrune row at one budget (all but SQA), so that budget is taken."""
    if label == "tab:budget":
        m = re.search(r"under a (\d+)-token budget", parse_table(tex, label)["caption"])
        assert m, "Table 4's caption no longer states its budget"
        return m.group(1)
    if label == "tab:diversity_algorithms":
        _, main = expected_cells(tex, "tab:main_llava-v15", None)
        _, div = expected_cells(tex, label, "?")
        dpp = div[("promprune", "?", "diversity=dpp")]
        shared = [c for c in dpp if c in main[("none", "", "")]]
        agree = {k[1]: sum(main[k][c] == dpp[c] for c in shared) for k in main if k[0] == "promprune"}
        best = max(agree, key=agree.get)
        assert agree[best] >= len(shared) - 1 and sorted(agree.values())[-2] < agree[best], agree
        return best
    return None


def table_number(tex: str, label: str) -> int:
    labels = re.findall(r"\\label\{(tab:[^{}]*)\}", tex)
    return labels.index(label) + 1


def read_csv(name: str) -> tuple[list[str], dict]:
    path = PAPER_DIR / f"{name}.csv"
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    by_key: dict = {}
    for r in rows:
        key = (r["method"], r["budget"], r["variant"])
        assert key not in by_key, f"{path.name}: duplicate row {key}"
        by_key[key] = r
    return header, by_key


# ---------------------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("label,name,number", TABLES, ids=[t[1] for t in TABLES])
def test_every_cell_of_the_table_is_shipped_as_printed(tex, label, name, number):
    assert table_number(tex, label) == number
    columns, expected = expected_cells(tex, label, budget_of(tex, label))
    header, rows = read_csv(name)

    assert set(header) == set(META) | set(columns), f"{name}.csv columns: {header}, the table's: {columns}"
    assert len(header) == len(set(header))
    assert set(rows) == set(expected), (f"{name}.csv rows {sorted(set(rows) ^ set(expected))} differ "
                                        "from the table's")
    for key, row in rows.items():
        assert row["source"] == f"paper Table {number}", f"{name}.csv {key}: source {row['source']!r}"
        shipped = {c: row[c] for c in columns if row[c] != ""}
        assert shipped == expected[key], f"{name}.csv {key}"  # both ways: none missing, none extra


@pytest.mark.parametrize("label,name,number", TABLES, ids=[t[1] for t in TABLES])
def test_the_loader_reads_each_table(tex, label, name, number):
    frame = load_published(name)
    assert frame is not None, f"{name}.csv is not shipped"
    columns, expected = expected_cells(tex, label, budget_of(tex, label))
    assert len(frame) == len(expected)
    for _, row in frame.iterrows():
        budget = "" if row["budget"] != row["budget"] else f"{row['budget']:.0f}"  # NaN for the unpruned model
        cells = expected[(row["method"], budget, row["variant"])]
        for col in columns:
            if col in cells:
                assert row[col] == pytest.approx(float(cells[col])), (name, row["method"], col)
            else:
                assert row[col] != row[col], (name, row["method"], col)  # NaN: the table has no such cell


def test_cell_counts(tex):
    """The size of each table, so a parser change that drops rows or columns shows."""
    counts = {name: sum(len(v) for v in expected_cells(tex, label, budget_of(tex, label))[1].values())
              for label, name, _ in TABLES}
    assert counts == {"table1_llava15": 190, "table2_llava_next": 60, "table3_qwen25vl": 60,
                      "table4_adaptive_vs_fixed": 23, "table5_diversity": 18, "table6_efficiency": 24}
