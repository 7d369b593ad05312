"""``python -m promprune.eval prepare``: build the offline tasks (easy-vqa, the prominence testbed) and print the
lmms-eval ``--include_path`` of each suite."""

import argparse

from promprune.eval.tasks import SUITES, prepare_offline_tasks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m promprune.eval", description=__doc__)
    parser.add_argument("command", choices=["prepare"], help="prepare: write the offline tasks once, print include paths")
    parser.parse_args(argv)
    for suite, (tasks, _) in SUITES.items():
        path = prepare_offline_tasks(suite)
        print(path)
        print(f"# {suite} tasks {', '.join(tasks)}: lmms-eval ... --tasks {tasks[0]} --include_path {path}")


if __name__ == "__main__":
    main()
