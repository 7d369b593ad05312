"""``python -m promprune.eval prepare``: build the offline tasks (easy-vqa, the prominence testbed) and print the
lmms-eval ``--include_path`` of each suite.

``python -m promprune.eval standins --out DIR``: write local stand-ins of the paper's nine hub datasets into ``DIR``
(an HF_HOME) and print the environment under which lmms-eval's own tasks load them offline."""

import argparse
import os
import sys
from pathlib import Path


def _prepare() -> None:
    from promprune.eval.tasks import SUITES, prepare_offline_tasks

    for suite, (tasks, _) in SUITES.items():
        path = prepare_offline_tasks(suite)
        _say(str(path))
        _say(f"# {suite} tasks {', '.join(tasks)}: lmms-eval ... --tasks {tasks[0]} --include_path {path}")


def _say(line: str) -> None:
    """Print ``line`` to a reader that may stop reading (``prepare | head -1``, as docs/pipeline.md uses it): once it
    has closed the pipe, stdout goes to the null device, so the rest is still prepared and nothing is printed as a
    BrokenPipeError traceback (Python's advice: https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _standins(out: Path, tasks: list[str], docs: int, seed: int) -> None:
    from promprune.eval.standins import build_standins, standin_env

    hf_home = build_standins(out, tasks=tasks, docs_per_task=docs, seed=seed)
    print(f"# stand-ins of {', '.join(tasks)} ({docs} documents each) in {hf_home / 'datasets'}; use them with:")
    for name, value in standin_env(hf_home).items():
        print(f"export {name}={value}")


def _positive_int(text: str) -> int:
    """argparse's type for --docs: an int >= 1 (an argparse error otherwise, not build_standins' ValueError)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


# the flags only standins reads (dest -> flag): given to prepare, an error rather than silently ignored
STANDINS_ONLY = {"out": "--out", "tasks": "--tasks", "docs": "--docs", "seed": "--seed"}


def main(argv=None) -> None:
    from promprune.eval.standins import STANDIN_TASKS

    parser = argparse.ArgumentParser(prog="python -m promprune.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "standins"],
                        help="prepare: write the offline tasks once, print include paths; "
                             "standins: write hub-dataset stand-ins into --out (an HF_HOME)")
    parser.add_argument("--out", type=Path, help="standins: the HF_HOME to write (a fresh directory)")
    parser.add_argument("--tasks", nargs="+", default=None, choices=STANDIN_TASKS, metavar="TASK",
                        help="standins: lmms-eval tasks whose data to write "
                             f"(default: all of {', '.join(STANDIN_TASKS)})")
    parser.add_argument("--docs", type=_positive_int, default=None, help="standins: documents per task, >= 1 "
                        "(default 8)")
    parser.add_argument("--seed", type=int, default=None, help="standins: seed of the drawn images and questions "
                        "(default 0)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        given = [flag for dest, flag in STANDINS_ONLY.items() if getattr(args, dest) is not None]
        if given:
            parser.error(f"{', '.join(given)}: only for standins (prepare takes no options)")
        _prepare()
    elif args.out is None:
        parser.error("standins needs --out DIR")
    else:
        _standins(args.out, args.tasks or list(STANDIN_TASKS), 8 if args.docs is None else args.docs,
                  0 if args.seed is None else args.seed)


if __name__ == "__main__":
    main()
