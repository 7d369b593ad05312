"""What a sweep's command line can be refused for before anything heavy loads (Ray, torch, lmms-eval: 10 s and more
of imports): a spec file too large to be a spec, one that cannot be read (missing, malformed YAML, a bad ``--set``),
and a ``--resume`` of a run whose driver is alive.

`pipelines/sweep.py` run as a script calls `refuse_early` before its own imports (and `not_started_on_interrupt`,
so a Ctrl-C during them ends it as one before the sweep starts, exit 130); the full checks after them
(`pipelines.spec`, `pipelines.preflight`, `pipelines.run.state`) say the same things, so this only ever refuses
sooner, never accepts: what it cannot judge here (the fields of a spec that reads, whose problems come in one message
with the methods' and the plugins', remote storage) it leaves to them.

Also the pieces of the one-driver lock that need no Ray: where the lock files are, which runs a spec has, who holds a
local lock (`pipelines.run.state.DriverLock` is built on them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import yaml

from pipelines import paths

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "sweeps" / "quickstart.yaml"
MAX_SPEC_BYTES = 4 << 20  # a spec is a few KB of YAML; more than this is read no further (a 50 MB file took 57 s)
STATE_DIR = "_promprune_state"  # beside Tune's experiments: each run's state, lock and outbox
LOCK_SUFFIX = ".lock"
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM
NOT_STARTED = "interrupted before the sweep started; run the same command again"


def too_large(path: str | Path) -> str | None:
    """Why the file at ``path`` cannot be a spec by its size alone (None: it may be)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        return None  # missing or unreadable: the loader says which
    if size <= MAX_SPEC_BYTES:
        return None
    return (f"the file is {size / 1e6:,.1f} MB, and a sweep spec is a few KB of YAML (at most {MAX_SPEC_BYTES >> 20} "
            "MiB is read); check that --config names the spec (sweeps/<name>.yaml), not a data or model file")


def read_capped(path: str | Path) -> bytes:
    """The file's first ``MAX_SPEC_BYTES + 1`` bytes (one more than a spec may hold: enough to tell it is too
    large, whatever `stat` said)."""
    with open(path, "rb") as f:
        return f.read(MAX_SPEC_BYTES + 1)


# ----------------------------------------------------------------------------------------------------------------
# the one-driver lock's files


def runs_of(name: str, file_names, suffix: str = ".json") -> list[str]:
    """The experiments of spec `name` among state-directory ``file_names`` with that ``suffix`` (`<name>-<time>`:
    a digit after the dash, so spec `rel` never takes `rel-b`'s runs), oldest first."""
    return sorted(f[:-len(suffix)] for f in file_names if f.endswith(suffix)
                  and f.startswith(f"{name}-") and f[len(name) + 1:][:1].isdigit())


def local_holder(lock_path: str) -> dict | None:
    """What holds the kernel lock on the local file ``lock_path`` now (its JSON: host, pid, since), None when
    nobody does; the lock is not taken."""
    import fcntl

    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return parse_holder(os.pread(fd, 1 << 16, 0))
    finally:
        os.close(fd)


def parse_holder(raw: bytes) -> dict:
    try:
        return json.loads(raw.decode() or "{}")
    except ValueError:
        return {}


def busy_message(experiment: str, holder: dict, earlier: list[str] | None = None) -> str:
    """The refusal of a second driver: who runs the sweep, since when, and how to stop it. ``earlier``: for a bare
    ``--resume`` (latest), which found this live run the newest, the spec's earlier runs no live driver holds,
    newest first (`idle_earlier_runs`): the one the user meant may be among them (an interrupted run, while a
    colleague's new run of the spec goes on), and stopping the live one, the only way out this said, is not it."""
    pid, host, since = holder.get("pid", "?"), holder.get("host", "?"), holder.get("since", "?")
    message = (f"sweep {experiment} is being run by a live driver (pid {pid} on {host}, since {since}), "
               "and two drivers of one sweep would run its trials twice and delete each other's saved blocks. Wait "
               f"for it to finish, or stop it (Ctrl-C in its terminal, `kill -INT {pid}` on {host}, or `ray job stop` "
               "for a Ray job; it saves its state) and resume then")
    if earlier:
        message += (f". --resume alone takes the newest run of the spec, this live one; to resume an earlier run "
                    f"instead, name it, e.g. `--resume {earlier[0]}` (earlier runs no driver holds, newest first: "
                    f"{', '.join(earlier)}; one that finished says so and starts nothing)")
    return message


MAX_EARLIER = 3  # earlier runs a busy refusal names


def idle_earlier_runs(experiment: str, found: list[str], held) -> list[str]:
    """The runs in ``found`` (a spec's runs with a state, oldest first) older than ``experiment`` whose lock
    ``held(run)`` says no live driver holds, newest first, at most `MAX_EARLIER`."""
    earlier = []
    for run in reversed(found):
        if len(earlier) == MAX_EARLIER:
            break
        if run < experiment and not held(run):
            earlier.append(run)
    return earlier


# ----------------------------------------------------------------------------------------------------------------
# the early refusals


def refuse(problem: str) -> NoReturn:
    """End the process as the entry points refuse a user's mistake: ``error: <problem>`` on stderr (the one
    paragraph that names what is wrong and the fix), exit 2 (`EXIT_BAD_INPUT`), no traceback."""
    print(f"error: {problem}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def refuse_early(argv: list[str]) -> None:
    """Exit 2 with the one-paragraph message `pipelines/sweep.py` would print later, when the command can already
    be refused; return otherwise (the full checks run next)."""
    problem = early_problem(argv)
    if problem is not None:
        refuse(problem)


def add_spec_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command line's spec arguments (``--config``, ``--set``, ``--resume``): declared once, for the early checks
    here and for ``pipelines/sweep.py``'s parser."""
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="sweep spec (default: sweeps/quickstart.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a spec field, value parsed as YAML (repeatable): --set limit=8 "
                        "--set grid.budget=[16,8]")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="EXPERIMENT",
                   help="resume the newest run started with this spec, --set overrides included (or the named one, "
                        "e.g. quickstart-20261121-080000): finished trials are kept, the same MLflow parent run "
                        "continues")
    return p


def early_problem(argv: list[str]) -> str | None:
    """The refusal decided here, as the full checks word it (``<where>: N problem(s): ...``): the spec file's size,
    a spec that cannot be read (``reading_problems``), a ``--resume`` whose run's driver holds its lock. None when
    none of these (or when this cannot tell: the full checks decide)."""
    if any(arg == "-h" or (len(arg) > 2 and "--help".startswith(arg)) for arg in argv):
        return None  # the help is printed whatever the spec (argparse's abbreviations of --help included)
    p = add_spec_args(argparse.ArgumentParser(add_help=False))
    try:
        args, _ = p.parse_known_args(argv)
    except SystemExit:  # a malformed command line: the CLI's own parser says how
        return None
    problem = too_large(args.config)
    if problem:
        return one_problem(args.config, problem)
    problem = reading_problems(args.config, args.overrides)
    if problem:
        return problem
    if args.resume is None:
        return None
    name, storage = peek(args.config, args.overrides)
    local = None if name is None else paths.local_storage(storage)
    if local is None:
        return None  # remote storage has no kernel lock: `state.DriverLock` checks its heartbeat
    state_dir = local / STATE_DIR
    try:
        names = os.listdir(state_dir)
    except OSError:
        return None
    found = runs_of(name, names)
    candidates = [args.resume] if args.resume != "latest" else \
        [e for e in runs_of(name, names, LOCK_SUFFIX) if not found or e >= found[-1]]  # a newer run setting up too
    for experiment in candidates:
        holder = local_holder(str(state_dir / f"{experiment}{LOCK_SUFFIX}"))
        if holder is not None:
            earlier = [] if args.resume != "latest" else idle_earlier_runs(
                experiment, found, lambda run: local_holder(str(state_dir / f"{run}{LOCK_SUFFIX}")) is not None)
            return one_problem(f"--resume {experiment}", busy_message(experiment, holder, earlier))
    return None


def one_problem(where: str, what: str) -> str:
    """A refusal of one problem, worded as ``pipelines.spec.SpecError`` words its lists."""
    return problems_at(where, [what])


def problems_at(where: str, whats: list[str]) -> str:
    """A refusal of every problem in ``whats`` at once, worded as ``pipelines.spec.SpecError`` words its lists."""
    lines = "\n".join(f"  - {what}" for what in whats)
    return f"{where}: {len(whats)} problem(s):\n{lines}"


def reading_problems(config: str, overrides: list[str]) -> str | None:
    """Why the spec cannot be read at all, as the full checks say it (``pipelines.spec.load_raw``: a missing or
    unreadable file, malformed YAML, not UTF-8, a broken ``include:``, a bad ``--set``; pydantic and YAML, no torch):
    under a second, where the full checks first wait ~7 s for Ray and torch. A spec that reads is left to them, so a
    schema problem is reported together with the methods' and the plugins' (every problem in one message). None:
    it reads."""
    from pipelines import spec as specs  # not at the top: pipelines.spec's loader imports this module

    try:
        specs.load_raw(config, overrides)
    except specs.SpecError as exc:
        return str(exc)
    return None


def peek(config: str, overrides: list[str]) -> tuple[str | None, str]:
    """The spec's ``name`` and its Tune storage (``tune.storage_path``, else ``$PROMPRUNE_STORAGE``, else the
    default) as the full loader would find them, read from the YAML alone (its ``include:`` chain, ``--set``
    overrides of those two fields); the name is None when this reading cannot tell."""
    name = storage = None
    path, seen = Path(config), set()
    while path is not None and path.resolve() not in seen and not too_large(path):
        seen.add(path.resolve())
        try:
            data = yaml.safe_load(read_capped(path).decode("utf-8")) or {}
        except (OSError, ValueError, yaml.YAMLError):
            return None, ""
        if not isinstance(data, dict):
            return None, ""
        tune = data.get("tune") if isinstance(data.get("tune"), dict) else {}
        name = name if name is not None else data.get("name")  # the including file wins
        storage = storage if storage is not None else tune.get("storage_path")
        include = data.get("include")
        path = path.parent / include if isinstance(include, str) else None
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() in ("name", "tune.storage_path"):
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                return None, ""
            name, storage = (parsed, storage) if key.strip() == "name" else (name, parsed)
    if not isinstance(name, str) or not (storage is None or isinstance(storage, str)):
        return None, ""
    return name, storage or os.environ.get(paths.STORAGE_ENV) or paths.default_storage()


def not_started_on_interrupt(on: bool = True) -> None:
    """``on``: from now on Ctrl-C or SIGTERM ends the process as `pipelines/sweep.py`'s ``main`` ends it before the
    sweep starts: `NOT_STARTED` on stderr, exit 130 (`EXIT_INTERRUPTED`). For the script's module-level imports
    (Ray, Tune, torch: 10 s and more), where a Ctrl-C was a 40-line KeyboardInterrupt traceback from inside an
    import, exit 1. ``on=False`` (before ``main``) gives both signals back the handlers they had before, SIGINT's
    KeyboardInterrupt for ``main``'s own handling. A signal the process inherited as ignored (a background job of a
    non-interactive shell starts with SIGINT ignored) stays ignored: it is not made to end the process.

    The handler ends the process with ``os._exit``: nothing has started that needs stopping, and an exception
    raised where the signal may land, importlib's module-lock bookkeeping, is swallowed there ("Exception
    ignored") and the import goes on (``pipelines.sweep.stop_on_sigterm``)."""
    import signal

    def not_started(signum, frame):
        sys.stdout.flush()
        print(f"\n{NOT_STARTED}", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    for signum in (signal.SIGINT, signal.SIGTERM):
        if on:
            before = signal.getsignal(signum)
            if before is not signal.SIG_IGN:
                _HANDLERS_BEFORE.setdefault(signum, before)
                signal.signal(signum, not_started)
        elif signum in _HANDLERS_BEFORE:
            signal.signal(signum, _HANDLERS_BEFORE.pop(signum))


_HANDLERS_BEFORE: dict = {}  # signal -> its handler before `not_started_on_interrupt` replaced it
