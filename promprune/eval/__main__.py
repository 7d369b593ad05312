"""``python -m promprune.eval prepare``: build the offline tasks (easy-vqa, the prominence testbed) and print the
lmms-eval ``--include_path`` of each suite.

``python -m promprune.eval standins --out DIR``: write local stand-ins of the paper's nine hub datasets into ``DIR``
(an HF_HOME) and print the environment under which lmms-eval's own tasks load them offline."""

import argparse
from pathlib import Path


def _prepare() -> None:
    from promprune.eval.tasks import SUITES, prepare_offline_tasks

    for suite, (tasks, _) in SUITES.items():
        path = prepare_offline_tasks(suite)
        print(path)
        print(f"# {suite} tasks {', '.join(tasks)}: lmms-eval ... --tasks {tasks[0]} --include_path {path}")


def _standins(out: Path, tasks: list[str], docs: int, seed: int) -> None:
    from promprune.eval.standins import build_standins, standin_env

    hf_home = build_standins(out, tasks=tasks, docs_per_task=docs, seed=seed)
    print(f"# stand-ins of {', '.join(tasks)} ({docs} documents each) in {hf_home / 'datasets'}; use them with:")
    for name, value in standin_env(hf_home).items():
        print(f"export {name}={value}")


def main(argv=None) -> None:
    from promprune.eval.standins import STANDIN_TASKS

    parser = argparse.ArgumentParser(prog="python -m promprune.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "standins"],
                        help="prepare: write the offline tasks once, print include paths; "
                             "standins: write hub-dataset stand-ins into --out (an HF_HOME)")
    parser.add_argument("--out", type=Path, help="standins: the HF_HOME to write (a fresh directory)")
    parser.add_argument("--tasks", nargs="+", default=list(STANDIN_TASKS), choices=STANDIN_TASKS, metavar="TASK",
                        help="standins: lmms-eval tasks whose data to write "
                             f"(default: all of {', '.join(STANDIN_TASKS)})")
    parser.add_argument("--docs", type=int, default=8, help="standins: documents per task (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="standins: seed of the drawn images and questions")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        _prepare()
    elif args.out is None:
        parser.error("standins needs --out DIR")
    else:
        _standins(args.out, args.tasks, args.docs, args.seed)


if __name__ == "__main__":
    main()
