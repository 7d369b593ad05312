"""An optional event timeline of a sweep: where its wall time goes (trials, actors, requests), across processes.

Off unless ``PROMPRUNE_TIMELINE`` names a folder: then every process of the sweep (the driver, Tune's trial
processes, the model workers) appends one JSON line per event to ``<folder>/<pid>.jsonl``, wall-clock stamped
(``time.time()``: the processes share one machine's clock, or NTP-synced nodes'). ``read`` merges them,
``write`` saves CSV or JSON, ``summary`` says where the time went. `benchmarks/sweep_scaling.py --timeline PATH`
turns it on.

Events (``where``: driver / trial / actor):
  driver  process_start (the CLI's process, from the OS), spec_checked (spec and preflight done), ray_up (Ray
          connected, MLflow's store open), sweep_begin, rows_built, weights_published, tune_start, trial_start (Tune
          started it), trial_recorded (its metrics reached MLflow), tune_end, sweep_end
  trial   trial_begin (run_trial entered), first_request (its first block sent to the actors), last_answer (its last
          batch back), trial_scored (lmms-eval scored it), trial_reported (tune.report returned)
  actor   a model worker's: actor_process (the process's start, from the OS), actor_init (its __init__ entered),
          actor_ready (model loaded), predict_start / predict_end (one block of one trial, tagged with the trial)
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import time
from pathlib import Path

ENV = "PROMPRUNE_TIMELINE"
FIELDS = ["run", "s", "t", "event", "where", "pid", "trial", "call", "rows", "node"]
_TAGS: dict = {}  # fields every later mark of this process carries (the trial a Tune trial process runs)


def tag(**fields) -> None:
    """Fields added to this process's later marks (None removes one)."""
    for key, value in fields.items():
        if value is None:
            _TAGS.pop(key, None)
        else:
            _TAGS[key] = value


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def mark(event: str, where: str, *, t: float | None = None, **fields) -> None:
    """Append one event to this process's file (nothing when the timeline is off)."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    line = {"t": time.time() if t is None else t, "event": event, "where": where, "pid": os.getpid(), **_TAGS,
            **fields}
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def process_started() -> float | None:
    """This process's start as wall-clock seconds (psutil; None without it)."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().create_time()


def read(folder: str | Path) -> list[dict]:
    """Every process's events, in time order."""
    events = []
    for path in Path(folder).glob("*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def write(events: list[dict], path: str | Path) -> None:
    """CSV (``.csv``) or JSON (anything else); ``s``: seconds since the first `sweep_begin` of the event's ``run``."""
    path = Path(path)
    begins: dict = {}
    for e in events:
        if e["event"] == "sweep_begin":
            begins.setdefault(e.get("run"), e["t"])
    events = [{**e, "s": round(e["t"] - begins[e.get("run")], 4)} if e.get("run") in begins else e for e in events]
    if path.suffix == ".csv":
        keys = list(dict.fromkeys(FIELDS + [k for e in events for k in e]))
        with open(path, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=keys)
            out.writeheader()
            out.writerows(events)
    else:
        path.write_text(json.dumps(events, indent=1, default=str) + "\n")


def _first(events: list[dict], name: str, **match) -> float | None:
    ts = [e["t"] for e in events if e["event"] == name and all(e.get(k) == v for k, v in match.items())]
    return min(ts) if ts else None


def _last(events: list[dict], name: str) -> float | None:
    ts = [e["t"] for e in events if e["event"] == name]
    return max(ts) if ts else None


def actor_busy(events: list[dict]) -> dict[int, float]:
    """Seconds each actor (by pid) spent inside predict calls."""
    busy: dict[int, float] = {}
    open_: dict[int, float] = {}
    for e in events:
        if e["event"] == "predict_start":
            open_[e["pid"]] = e["t"]
        elif e["event"] == "predict_end" and e["pid"] in open_:
            busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["t"] - open_.pop(e["pid"])
    return busy


def summary(events: list[dict]) -> list[str]:
    """Where the time went, in lines: the start-up phases from `sweep_begin`, the actors' busy share, and the
    median trial's phases."""
    t0 = _first(events, "sweep_begin")
    end = _last(events, "sweep_end")
    if t0 is None or end is None:
        return ["timeline: no complete sweep (sweep_begin / sweep_end missing)"]
    at = {name: _first(events, name) for name in ("rows_built", "weights_published", "actor_process",
                                                  "actor_init", "tune_start", "trial_start",
                                                  "trial_begin", "first_request", "predict_start", "last_answer",
                                                  "trial_recorded")}
    at["last actor_ready"] = _last(events, "actor_ready")
    at["first actor_ready"] = _first(events, "actor_ready")
    at["last trial_recorded"] = _last(events, "trial_recorded")
    at["tune_end"] = _first(events, "tune_end")
    lines = [f"timeline: {end - t0:.1f} s from sweep_begin to sweep_end; first of each event at (s):"]
    lines += _before(events, t0)
    lines.append("  " + ", ".join(f"{k} {v - t0:.1f}" for k, v in sorted(at.items(), key=lambda kv: kv[1] or 0)
                                  if v is not None))
    busy = actor_busy(events)
    ready = {e["pid"]: e["t"] for e in events if e["event"] == "actor_ready"}
    if busy:
        alive = sum(end - ready.get(pid, t0) for pid in busy)
        lines.append(f"  actors: {len(busy)} served; busy {sum(busy.values()):.1f} s of {alive:.1f} s alive after "
                     f"ready ({sum(busy.values()) / max(alive, 1e-9):.0%}); of {len(busy) * (end - t0):.1f} s "
                     f"actor-seconds since sweep_begin ({sum(busy.values()) / (len(busy) * (end - t0)):.0%})")
    phases = _trial_phases(events)
    if phases:
        med = {k: sorted(p[k] for p in phases)[len(phases) // 2] for k in phases[0]}
        lines.append(f"  median of {len(phases)} trials (s): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    return lines


def _before(events: list[dict], t0: float) -> list[str]:
    """The CLI's time before `sweep_begin` (from `process_start`: imports, the spec and preflight checks, Ray's
    start), when the CLI wrote it."""
    names = ["process_start", "spec_checked", "ray_up"]
    at = {n: _first(events, n) for n in names}
    if any(v is None for v in at.values()):
        return []
    steps = list(zip(names, names[1:] + ["sweep_begin"]))
    ends = {**at, "sweep_begin": t0}
    return ["  before the sweep (s): " + ", ".join(f"{a}->{b} {ends[b] - ends[a]:.1f}" for a, b in steps)]


def _trial_phases(events: list[dict]) -> list[dict]:
    """Per trial: Tune start -> run_trial, -> first request, -> last answer (predicting), -> scored, -> reported,
    -> recorded in MLflow by the driver."""
    names = ["trial_start", "trial_begin", "first_request", "last_answer", "trial_scored", "trial_reported",
             "trial_recorded"]
    by_trial: dict[str, dict] = {}
    for e in events:
        if e.get("trial") and e["event"] in names:
            by_trial.setdefault(e["trial"], {}).setdefault(e["event"], e["t"])
    out = []
    for marks in by_trial.values():
        if all(n in marks for n in names):
            out.append({f"{a}->{b}": marks[b] - marks[a] for a, b in itertools.pairwise(names)})
    return out
