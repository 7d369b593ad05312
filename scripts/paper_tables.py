"""Write `pipelines/paper_results/tables.tex`: the paper's tables as data, so the tests check the shipped CSVs against
the published cells inside the repository.

    python scripts/paper_tables.py [path/to/promprune.tex]      # default: ../shared/paper/promprune.tex

Every `table` environment of the paper that carries a `\\label{tab:...}` is copied in order with its tabular as
printed; its caption is dropped (prose), except the facts a table states only there (``under a 64-token budget``).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "pipelines" / "paper_results" / "tables.tex"
FACTS = re.compile(r"under a \d+-token budget")


def _caption_end(tex: str, start: int) -> int:
    """The index after the closing brace of the `\\caption{` at ``start``."""
    depth = 0
    for i in range(tex.index("{", start), len(tex)):
        depth += {"{": 1, "}": -1}.get(tex[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError("unclosed caption")


def tables(tex: str) -> list[str]:
    """The labelled table environments, captions reduced to their facts."""
    out = []
    for m in re.finditer(r"\\begin\{table\*?\}.*?\\end\{table\*?\}", tex, flags=re.S):
        env = m.group(0)
        if not re.search(r"\\label\{tab:", env):
            continue
        at = env.find("\\caption{")
        while at >= 0:
            end = _caption_end(env, at)
            kept = f"\\caption{{{' '.join(FACTS.findall(env[at:end]))}}}"
            env = env[:at] + kept + env[end:]
            at = env.find("\\caption{", at + len(kept))
        out.append(env)
    return out


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else REPO.parent / "shared" / "paper" / "promprune.tex"
    tex = "\n".join(re.sub(r"(?<!\\)%.*$", "", line) for line in source.read_text(encoding="utf-8").splitlines())
    found = tables(tex)
    OUT.write_text("% The paper's labelled tables as printed (numbers are facts: data), captions reduced to the facts\n"
                   f"% they alone state. Written by scripts/paper_tables.py from {source.name}; do not edit.\n\n"
                   + "\n\n".join(found) + "\n", encoding="utf-8")
    print(f"{len(found)} tables -> {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
