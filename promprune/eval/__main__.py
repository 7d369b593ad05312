"""``python -m promprune.eval prepare``: build the offline easy-vqa tasks and print lmms-eval's --include_path."""

import argparse

from promprune.eval.tasks import OFFLINE_TASKS, prepare_offline_tasks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m promprune.eval", description=__doc__)
    parser.add_argument("command", choices=["prepare"], help="prepare: convert easy-vqa once, print the include path")
    parser.parse_args(argv)
    path = prepare_offline_tasks()
    print(path)
    print(f"# tasks {', '.join(OFFLINE_TASKS)}: lmms-eval ... --tasks {OFFLINE_TASKS[0]} --include_path {path}")


if __name__ == "__main__":
    main()
