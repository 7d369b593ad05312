"""Benchmarks: each script prints its table; benchmarks/RESULTS.md records them with their commands.

`Flags` is what every script checks its command line with: a user's mistake (a count below 1, an unknown method,
model or shape, a budget the model cannot keep, a dtype or device that is not there, a missing input, an output that
cannot be written) is refused before the script's expensive work, as the pipelines' entry points refuse theirs
(`pipelines.frontdoor.refuse`: one message naming each flag and its fix, exit 2, no traceback)."""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path


def pythonpath(first) -> str:
    """PYTHONPATH for a child process: ``first`` (a checkout) ahead of what this process was given, which keeps
    packages installed beside the environment reachable (the GPU machine's wheel batches, `pip --target` folders)."""
    return os.pathsep.join(dict.fromkeys(p for p in (str(first), *os.environ.get("PYTHONPATH", "").split(os.pathsep))
                                         if p))


# what an lmms-eval run logs where it went wrong and still exits 0: its command line's catch-all, which follows every
# error while it evaluates (a model that cannot load, a TypeError in a model's call); this package's plugin's warning
# for a failed sample (scored as a wrong answer, `lmms_plugin.generate_until`); lmms-eval's own llava models' error
# for a failed generation (they answer "" and go on)
LMMS_EVAL_FAILURES = {"Error during evaluation": "lmms-eval reported an error",
                      r"\bdoc \S+ failed: ": "the promprune plugin failed a sample",
                      "in generating": "lmms-eval's model failed a generation"}


def lmms_eval_problem(out: Path, log: str, tasks: list[str], limit: int) -> str | None:
    """Why one `lmms-eval` run did not answer and score ``limit`` documents of each of ``tasks``, or None where it
    did. ``out``: its ``--output_path``; ``log``: its stdout and stderr. Its exit status cannot tell: lmms-eval's
    command line logs an error while it evaluates ("Error during evaluation"), writes no results and exits 0, and a
    failed sample is logged and scored as a wrong answer. So this reads the log (:data:`LMMS_EVAL_FAILURES`) and the
    results file the run wrote (``<out>/<model>/<time>_results.json``): each task's ``n-samples`` answered and a
    numeric metric in its results."""
    for pattern, what in LMMS_EVAL_FAILURES.items():
        found = re.search(f"^.*{pattern}.*$", log, re.MULTILINE)
        if found:
            return f"{what}: {found.group(0).strip()[-500:]}"
    results = lmms_eval_results(out)
    if results is None:
        return f"lmms-eval wrote no results file under {out}"
    problems = []
    for task in tasks:
        answered = lmms_eval_answered(results, task)
        scores = {k: v for k, v in results.get("results", {}).get(task, {}).items()
                  if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if answered != limit:
            problems.append(f"{task}: {answered} of {limit} documents answered")
        elif not scores:
            problems.append(f"{task}: no score")
    return f"{results['file']}: " + "; ".join(problems) if problems else None


def lmms_eval_results(out: Path) -> dict | None:
    """The results file an `lmms-eval` run with ``--output_path out`` wrote (the newest, its path as ``file``), or
    None where it wrote none."""
    written = sorted(Path(out).glob("*/*_results.json"))
    return {**json.loads(written[-1].read_text()), "file": str(written[-1])} if written else None


def lmms_eval_answered(results: dict, task: str) -> int:
    """Documents of ``task`` that lmms-eval answered and scored, from its results (:func:`lmms_eval_results`)."""
    return int(results.get("n-samples", {}).get(task, {}).get("effective", 0))


def comma_list(item=str, example: str = "a,b"):
    """An argparse type: a comma-separated list, each item through ``item`` (a ValueError there: argparse's error
    naming the flag and the form, exit 2)."""
    def parse(text: str) -> list:
        try:
            return [item(part.strip()) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, e.g. {example}, got {text!r}") from None
    parse.__name__ = "comma-separated list"
    return parse


class Flags:
    """The problems of one benchmark script's command line, each naming its flag, refused together by `refuse`.

    Every check records a problem and returns what the script needs from it (a model's visual-token capacity, the
    parsed shapes); none imports torch or the models unless the flag needs them (an unknown method needs the
    registry)."""

    def __init__(self, script: str):
        self.where = f"benchmarks/{Path(script).name}"
        self.problems: list[str] = []

    def add(self, flag: str, problem: str) -> None:
        self.problems.append(f"{flag}: {problem}")

    def refuse(self) -> None:
        """Exit 2 with every problem in one message (`pipelines.frontdoor.refuse`); return when there is none."""
        if self.problems:
            from pipelines.frontdoor import problems_at, refuse

            refuse(problems_at(self.where, self.problems))

    # ------------------------------------------------------------------------------------------------------------
    # numbers

    def at_least(self, flag: str, value, low: float = 1, what: str = "", example=None) -> None:
        """``value`` (a number or a list of them; None passes: the flag's default) is at least ``low``."""
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in values if v is not None and v < low]
        if bad:
            shown = " ".join(f"{v:g}" for v in bad)
            hint = f", e.g. {flag} {example}" if example is not None else ""
            self.add(f"{flag} {shown}", f"must be at least {low:g}{f' ({what})' if what else ''}{hint}")

    def budgets(self, flag: str, budgets, capacity: int | None, model: str) -> None:
        """Every budget (None: unpruned) is at least 1 and at most the ``capacity`` visual tokens ``model`` gives an
        image (None: it depends on the image, unchecked)."""
        self.at_least(flag, [b for b in budgets if b is not None], 1, "the visual tokens kept of each image")
        over = [b for b in budgets if b is not None and capacity is not None and b > capacity]
        if over:
            self.add(f"{flag} {' '.join(map(str, over))}", f"{model} gives an image at most {capacity} visual "
                     f"tokens, so a budget above that prunes nothing; use budgets from 1 to {capacity}")

    # ------------------------------------------------------------------------------------------------------------
    # names

    def choice(self, flag: str, names, valid, what: str = "") -> list:
        """Each of ``names`` is one of ``valid``; returns those that are."""
        from promprune.suggest import did_you_mean

        valid = list(valid)
        for name in names:
            if name not in valid:
                self.add(f"{flag} {name}", f"unknown{f' {what}' if what else ''} {name!r}{did_you_mean(name, valid)}; "
                         f"valid: {', '.join(map(str, valid))}")
        return [n for n in names if n in valid]

    def methods(self, flag: str, names, stage: str | None = None) -> list[str]:
        """Each of ``names`` is a registered method (of ``stage``: ``pre_llm``, ``in_llm``; None: any); returns
        those that are."""
        import promprune

        known = promprune.methods(stage)
        for name in names:
            if name not in known:
                try:
                    spec = promprune.method_spec(name)
                except ValueError as exc:
                    self.add(f"{flag} {name}", f"{exc}; see docs/methods.md")
                else:
                    self.add(f"{flag} {name}", f"{name} is a {spec.stage} method and this benchmark times "
                             f"{stage} ones: {', '.join(known)}")
        return [n for n in names if n in known]

    def tasks(self, flag: str, tasks: list[str], limit: int | None = None, limit_flag: str = "--limit") -> None:
        """Every task is known and would load here with ``limit`` (`pipelines.preflight.check_tasks`, a sweep's
        check: lmms-eval's task index is read only for a task that is not an offline one)."""
        from promprune.eval.tasks import lmms_eval_silenced
        from pipelines.preflight import check_tasks

        with lmms_eval_silenced():  # its DEBUG lines while it indexes its task files read like a crash
            problems = check_tasks(tasks, limit)
        for problem in problems:
            field, _, what = problem.partition(": ")
            self.add({"tasks": flag, "limit": limit_flag}.get(field, flag), what)

    def model(self, flag: str, name: str, adapter_options: dict | None = None) -> int | None:
        """``name`` (a checkpoint, path, ``tiny:``/``testbed:``/``shape:`` name) resolves on this machine, from its
        config alone (no weights load); returns its visual-token capacity (None: unknown, or depends on the image)."""
        from promprune.models.adapters import model_capacity

        try:
            return model_capacity(name, adapter_options)
        except ValueError as exc:  # NotCachedError too: the benchmark would need it here
            self.add(f"{flag} {name}", str(exc))
        return None

    def dtype(self, flag: str, name, allow_auto: bool = False) -> None:
        """``name`` is a dtype (`promprune.dtypes`; None or ``auto`` with ``allow_auto``)."""
        from promprune.dtypes import parse_dtype

        if name is None and allow_auto:
            return
        try:
            parse_dtype(name, allow_auto=allow_auto)
        except ValueError as exc:
            self.add(f"{flag} {name}", str(exc))

    def device(self, flag: str, name: str, kinds=("cpu", "cuda"), words=(), indexed: bool = True) -> None:
        """``name`` is a device of ``kinds`` this machine has (``cuda``, ``cuda:N`` unless not ``indexed``: a CUDA GPU
        that torch sees), or one of ``words`` (a device map's ``auto``, say)."""
        if name in words:
            return
        import torch

        try:
            device = torch.device(name)
        except (RuntimeError, ValueError):
            device = None
        if device is None or device.type not in kinds or (not indexed and name not in kinds):
            forms = [*words, *kinds] + (["cuda:N"] if "cuda" in kinds and indexed else [])
            self.add(f"{flag} {name}", f"not a device this benchmark runs on; use one of {', '.join(forms)}")
        elif device.type == "cuda" and not torch.cuda.is_available():
            self.add(f"{flag} {name}", "this machine has no CUDA GPU that torch can use (torch.cuda.is_available() "
                     "is False); run it on a GPU machine, or use --device cpu where the script runs on the CPU")
        elif device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            self.add(f"{flag} {name}", f"this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0; "
                     "use cuda or cuda:0")

    # ------------------------------------------------------------------------------------------------------------
    # paths

    def existing(self, flag: str, path, kind: str = "directory", inside: str | None = None) -> None:
        """``path`` is an existing ``kind`` (``file`` or ``directory``), and holds ``inside`` when given."""
        if path is None:
            return
        p = Path(path)
        ok = p.is_file() if kind == "file" else p.is_dir()
        if not ok:
            self.add(f"{flag} {path}", f"no such {kind}" + (" (a relative path is from the working directory)"
                                                             if not p.is_absolute() else ""))
        elif inside is not None and not (p / inside).exists():
            self.add(f"{flag} {path}", f"{p} has no {inside}; give the folder that holds it")

    def writable(self, flag: str, path, kind: str = "file") -> None:
        """``path`` (a ``file`` or ``directory`` the script will write) can be made: not an existing thing of the
        other kind, under a folder (existing, or to be made in one that exists) this process may write in."""
        if path is None:
            return
        p = Path(path).absolute()
        if kind == "file" and p.is_dir():
            self.add(f"{flag} {path}", "is a directory; give a file name in it")
            return
        if kind == "directory" and p.exists() and not p.is_dir():
            self.add(f"{flag} {path}", "is a file; give a directory (it is made when missing)")
            return
        folder = p if kind == "directory" and p.is_dir() else p.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            self.add(f"{flag} {path}", f"{folder} is not a directory")
        elif not os.access(folder, os.W_OK | os.X_OK):
            self.add(f"{flag} {path}", f"cannot write in {folder} (permission denied); give a path in a folder "
                     "you can write")
