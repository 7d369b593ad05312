"""What the console shows of a sweep's trials: a line as each starts and ends, the progress bar in samples
(`SweepConsole`), and at the end the summary table, each method's paired difference to the best other, and the best
(mu, tau) of each (mu, tau) search with the samples generated (`summary_table`, `paired_lines`, `best_line`;
`best_trial` and `best_metrics` give a sweep's only search's best trial to the parent run).

A trial's *record* is the dict `pipelines.recording.results.SweepResults` keeps: ``trial`` (its config), ``metrics``,
``scores``, ``predictions`` (a pyarrow table or None), ``error`` (None, or the failure's text) and, for a trial a
scheduler stopped, ``stopped`` (``scored``, ``done``, ``total``, ``running``, ``why``)."""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import pandas as pd

from pipelines import mlflow_layout
from pipelines import spec as specs
from pipelines.console import say
from pipelines.mlflow_layout import MU_TAU, REL
from pipelines.run import search

# no trial has said anything (started, reported a block, ended) for this long while trials run: one line saying what
# the sweep's model workers are doing; the next after twice the silence so far, then at most every `QUIET_MAX_S`
QUIET_S = 60.0
QUIET_MAX_S = 600.0


class SweepConsole:
    """A line per trial as it starts (or resumes) and ends, and the sweep's progress bar (``bar``, set while Tune
    runs), moved by the samples each trial answers; when trials run and none has reported for `QUIET_S`, a line on
    what they wait for (`tick`, on each step of Tune's loop).

    ``samples``: each known trial's samples (a trial optuna chooses runs on every task: ``per_trial``);
    ``saved``: the samples a trial has saved in blocks (answered before a retry or a `--resume`; None: none kept);
    ``workers``: the state of the sweep's pool of model workers (`WorkerPool.state`), None when it cannot say."""

    def __init__(self, n_trials: int, samples: dict[str, int] | None = None, per_trial: int | None = None,
                 saved: Callable[[str], int] | None = None, workers: Callable[[], dict | None] | None = None):
        self.n_trials, self.samples_of, self.per_trial = n_trials, samples or {}, per_trial
        self.saved = saved or (lambda tid: 0)
        self.workers = workers
        self.bar = None
        self.shown: dict[str, int] = {}  # trial id -> samples counted on the bar
        self.running: set[str] = set()  # trials started and not yet ended
        self.heard, self.quiet_after = time.monotonic(), QUIET_S  # the last trial event; the silence said next

    def _heard(self) -> None:
        self.heard, self.quiet_after = time.monotonic(), QUIET_S

    def tick(self) -> None:
        """Trials running and silent for `QUIET_S` (then twice as long, ...): one line on the model workers."""
        quiet = time.monotonic() - self.heard
        if not self.running or quiet < self.quiet_after:
            return
        self.quiet_after = min(2 * quiet, quiet + QUIET_MAX_S)
        state = None
        if self.workers is not None:
            try:
                state = self.workers()
            except Exception:  # noqa: BLE001 - the pool busy or gone: the line says less, the sweep goes on
                state = None
        say(quiet_line(quiet, len(self.running), state))

    def ended(self, tid: str) -> None:
        """A trial ended (finished, stopped by a scheduler, or failed): it no longer counts as running."""
        self.running.discard(tid)
        self._heard()

    def total_of(self, tid: str) -> int | str:
        """A trial's samples."""
        return self.samples_of.get(tid, self.per_trial or "?")

    def started(self, tid: str) -> None:
        """A trial (re)started: one line saying how much of it is already done (its saved blocks, which it does not
        generate again)."""
        self.running.add(tid)
        self._heard()
        done = self.saved(tid)
        if done:
            say(f"[resume] {tid}: {done} of {self.total_of(tid)} samples already done")
            self.advanced(tid, done)
        else:
            say(f"[start] {tid}")

    def repeated(self, tid: str, earlier: dict | None, count: int) -> None:
        """Optuna proposed trial ``tid`` again: ``earlier`` is its record (it finished, was stopped, or failed), None
        while it still runs under the earlier proposal; ``count``: the trials ended so far. One line, ``[count/N]``,
        saying what becomes of the proposal, with one trial and its samples fewer to come: the counter's total and the
        bar's count the distinct trials the sweep runs (as the parent run's ``trials`` and ``trials/total`` do)."""
        self._heard()
        self.n_trials -= 1
        if self.bar is not None:
            self.bar.total -= self.per_trial or 0
            self.bar.refresh()
        say(f"[{count}/{self.n_trials}] {tid}: optuna proposed it again, {repeat_fate(earlier)}")

    def advanced(self, tid: str, done: int) -> None:
        """A trial's samples done so far (its progress reports): the bar moves by the new ones."""
        self._heard()
        new = done - self.shown.get(tid, 0)
        if new > 0:
            self.shown[tid] = done
            if self.bar is not None:
                self.bar.update(new)

    def finished(self, rec: dict, count: int, tasks: list[str]) -> None:
        """``[count/N] <trial>: <headline metrics> rel=... (<wall>s)`` for a trial that ran to its end."""
        m, tid = rec["metrics"], rec["trial"]["trial_id"]
        self.ended(tid)
        shown = " ".join(f"{k}={m[k]:.3f}" for k in headline_keys(tasks, m) + [REL] if k in m)
        failed = int(m.get("samples/failed", 0))
        shown += f" FAILED SAMPLES={failed} (scored as wrong answers)" if failed else ""
        shown += nan_note(m)
        say(f"[{count}/{self.n_trials}] {tid}: {shown} ({m.get('trial/wall_s', float('nan')):.1f}s)")
        self.advanced(tid, int(m.get("samples/total", 0)))
        if self.bar is not None:
            self.bar.set_postfix_str(f"{count}/{self.n_trials} trials", refresh=True)

    def stopped(self, rec: dict, count: int) -> None:
        """A trial a scheduler stopped: why, and the bar's total less the samples it will never generate."""
        tid, stop = rec["trial"]["trial_id"], rec["stopped"]
        self.ended(tid)
        say(f"[{count}/{self.n_trials}] {tid}: {stop['why']}")
        self.advanced(tid, stop["done"])
        if self.bar is not None and stop["total"] > stop["done"]:
            self.bar.total -= stop["total"] - max(stop["done"], self.shown.get(tid, 0))
            self.bar.refresh()


def repeat_fate(earlier: dict | None) -> str:
    """What becomes of an optuna proposal of a trial the sweep has (``earlier``: its record) or is running (None)."""
    if earlier is None:
        return ("while it runs under the earlier proposal: counted once (this proposal answers beside it the samples "
                "not saved yet, and its result goes to optuna too)")
    if earlier.get("stopped"):
        return ("a trial ASHA stopped: not run again (ASHA ends it at once with the result it stopped it on, which "
                "goes to optuna)")
    if earlier["error"] is not None:
        return ("a trial that failed: tried again from its saved answers, counted once (its record stays the "
                "failure; --resume runs failed trials again)")
    return ("a trial that already ran: not run again (no sample generated: its saved answers are scored again and "
            "the same result goes to optuna)")


def quiet_line(quiet_s: float, running: int, state: dict | None) -> str:
    """What a silent sweep waits for, from its pool's state (`pool.Pool.state`; None: unknown)."""
    head = f"no trial has reported for {quiet_s:.0f}s ({running} running)"
    if state is None:
        return head
    workers, up, granted = state["workers"], state["up"], state["granted"]
    if workers == 0:
        return f"{head}: the pool holds no model worker (none asked for yet, or none could start)"
    if up < workers:
        return (f"{head}: {up} of {workers} model worker(s) up, the rest still loading the model (Ray starts its "
                "workers at nice 15 unless RAY_worker_niceness says otherwise: other busy processes on a node slow "
                "them)")
    return f"{head}: {granted} of {workers} model worker(s) answering a block"


def nan_note(metrics: dict) -> str:
    """`` NaN SCORES: <task>/<metric> on <n> sample(s)`` for every metric a task's process_results returned NaN for
    (`promprune.eval.scoring.NAN_SUFFIX`: the score is what its aggregation made of them); empty when none."""
    from promprune.eval.scoring import NAN_SUFFIX

    nans = [f"{k.removesuffix(NAN_SUFFIX)} on {int(v)} sample(s)" for k, v in metrics.items()
            if k.endswith(NAN_SUFFIX) and v]
    return f" NaN SCORES: {', '.join(nans)} (the task's process_results returned NaN)" if nans else ""


def headline_keys(tasks: list[str], metrics: dict) -> list[str]:
    """Each task's primary metric(s) (`promprune.eval.tasks.primary_metrics`, what Rel. uses), else its first
    metric; never a sample count or an interval's bound (a task with no metric has no headline)."""
    from promprune.eval.scoring import is_count
    from promprune.eval.tasks import primary_metrics

    keys = []
    for task in tasks:
        primary = [f"{task}/{m}" for m in primary_metrics(task)]
        keys += [k for k in primary if k in metrics] or \
            [k for k in metrics if k.startswith(f"{task}/") and not is_count(k.split("/", 1)[1])][:1]
    return keys


def in_spec_order(spec: specs.SweepSpec, records: dict) -> dict:
    """``records`` in the spec's trial order (baseline, grid, explicit trials; trials a searcher chose after them, by
    id), not in the order the trials finished: the console prints the same table on every run."""
    order = {t.trial_id: i for i, t in enumerate(specs.expand(spec))}
    return {tid: records[tid] for tid in sorted(records, key=lambda t: (order.get(t, len(order)), t))}


def summary_table(spec: specs.SweepSpec, records: dict) -> str:
    """Markdown table: one row per trial that ran to its end (or failed), in the spec's order, with the headline
    metric per task, Rel. and the mean visual tokens, then one line of prefill times; trials a scheduler stopped
    are counted below it, not shown as rows.

    The table holds only what the answers decide (scores to 4 decimals, tokens), so a rerun prints it byte for byte
    again (the README's quickstart block is this table); the prefill times, which are this machine's clock, are
    the line below it. A calibrated mu shows in the method cell (the trial id says ``mu=calibrate``)."""
    rows = []
    stopped = [tid for tid, rec in records.items() if rec.get("stopped")]
    keys: list[str] = []
    for tid, rec in in_spec_order(spec, records).items():
        if rec.get("stopped"):
            continue
        m, t = rec["metrics"], rec["trial"]
        keys += [k for k in headline_keys(spec.tasks, m) if k not in keys]
        rows.append((tid, rec, m, t))
    if not rows:
        table = "(no trials)"
    else:
        header = ["trial", "method", "budget", *keys, "Rel.", "visual tokens", "failed"]
        lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
        for tid, rec, m, t in rows:
            cells = [tid, _method_cell(t), str(t["budget"]) if t["budget"] else "-"]
            cells += [f"{m[k]:.4f}" if k in m else "-" for k in keys]
            cells += [f"{m[REL]:.4f}" if REL in m else "-", _fmt_cell(m.get("efficiency/visual_tokens")),
                      "ERROR" if rec["error"] else str(int(m.get("samples/failed", 0)))]
            lines.append("| " + " | ".join(cells) + " |")
        times = [f"{tid} {_fmt_cell(m.get('efficiency/prefill_ms'))}" for tid, _, m, _ in rows]
        table = "\n".join(lines) + "\nprefill ms per sample (this machine's clock): " + ", ".join(times)
    if stopped:
        table += (f"\n{len(stopped)} more trial(s) stopped early by ASHA, not in the table (MLflow: status KILLED, tag "
                  f"{mlflow_layout.STOPPED}, running scores under {mlflow_layout.RUNNING}/)")
    return table


def _method_cell(trial: dict) -> str:
    """``promprune``, or ``promprune (mu calibrated: 0.2419)`` for a trial whose mu the sweep calibrated."""
    method = trial["method"] or "none"
    if trial.get("mu_source") == "calibration":
        return f"{method} (mu calibrated: {trial['options']['mu']:.4f})"
    return method


def _fmt_cell(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.1f}"


def searches(spec: specs.SweepSpec, records: dict) -> list[tuple[mlflow_layout.SearchKey, list[str]]]:
    """The (mu, tau) searches among the records' trials (`mlflow_layout.mu_tau_searches`, as the report's planes):
    per `mlflow_layout.search_key`, the trials that set mu or tau alike in all else (method, budget, tasks and every
    other option, an unset one read as the method's default) where they hold two or more distinct (mu, tau); in the
    spec's trial order (`in_spec_order`: trials it does not list, by id). Fig. 4's per-metric calibrated mus, one
    trial per metric, are none."""
    trials = {tid: rec["trial"] for tid, rec in in_spec_order(spec, records).items()}
    return mlflow_layout.trial_searches({tid: (t["method"], t["budget"], t.get("tasks") or spec.tasks, t["options"])
                                         for tid, t in trials.items()})


def best_trials(spec: specs.SweepSpec, records: dict) -> list[dict]:
    """Per (mu, tau) search (`searches`), its finished trial of the best search metric (a tie goes to the first trial
    id, whatever order the trials finished in): ``{search, trial_id, metric, value, mu, tau}``, and for Rel. its 95%
    paired bootstrap interval (``low``, ``high``: the documents resampled, the baseline on the same draw; the spec's
    `bootstrap` resamples, else `pipelines.reporting.paired.ITERS`). ``search``: what tells it from the sweep's
    other searches (`mlflow_layout.search_labels`; empty for a sweep's only search). A search with no finished trial:
    ``trial_id`` None. Empty for a sweep with no search."""
    metric, sign = spec.tune.metric, (1 if spec.tune.mode == "max" else -1)
    found = searches(spec, records)
    out = []
    for (_, tids), label in zip(found, mlflow_layout.search_labels([key for key, _ in found])):
        done = [records[tid] for tid in tids if not records[tid].get("stopped") and records[tid]["error"] is None
                and metric in records[tid]["metrics"]]
        if not done:
            out.append({"search": label, "trial_id": None, "metric": metric})
            continue
        rec = min(done, key=lambda r: (-sign * r["metrics"][metric], r["trial"]["trial_id"]))
        tid = rec["trial"]["trial_id"]
        out.append({"search": label, "trial_id": tid, "metric": metric, "value": float(rec["metrics"][metric]),
                    **{k: rec["trial"]["options"].get(k) for k in MU_TAU}, **_interval(spec, records, tid, metric)})
    return out


def _interval(spec: specs.SweepSpec, records: dict, tid: str, metric: str) -> dict[str, float]:
    """``{low, high}``: the trial's Rel. 95% paired bootstrap interval against the baseline; empty for another
    metric, without the baseline's or the trial's answers, or on other documents than the baseline's."""
    base, rec = records.get(search.BASELINE_ID), records[tid]
    if metric != REL or base is None or base.get("predictions") is None or rec["predictions"] is None:
        return {}
    from pipelines.reporting import paired

    rows = {tid: rec["predictions"], search.BASELINE_ID: base["predictions"]}
    try:
        boot = paired.bootstrap([tid], search.BASELINE_ID, lambda t: paired.rows_from(rows[t]),
                                iters=spec.bootstrap or paired.ITERS)
    except ValueError:  # the best trial ran on other documents than the baseline, or Rel. is undefined
        return {}
    if boot is None:
        return {}
    _, low, high = (float(x) for x in boot.rel(tid))
    return {"low": low, "high": high}


def parent_best(bests: list[dict]) -> dict | None:
    """The best trial the parent run holds (`best_metrics`, tag `promprune.best_trial`): the sweep's one search's,
    when it has one finished; None for no search, or several (each one's best is a line of the console and of the
    parent's description, `best_line`; no ``best/*`` metric names one of them the sweep's)."""
    return bests[0] if len(bests) == 1 and bests[0]["trial_id"] is not None else None


def best_trial(spec: specs.SweepSpec, records: dict) -> dict | None:
    """The parent run's best trial (`parent_best` of `best_trials`)."""
    return parent_best(best_trials(spec, records))


def best_metrics(best: dict | None) -> dict[str, float]:
    """The parent run's metrics of its best trial (`parent_best`): ``best/<metric>`` (with ``_ci_low`` /
    ``_ci_high``), ``best/mu``, ``best/tau`` (the options it sets); none without one."""
    if best is None:
        return {}
    name = f"best/{best['metric']}"
    out = {name: best["value"]}
    out.update({f"{name}_ci_{side}": best[side] for side in ("low", "high") if side in best})
    out.update({f"best/{k}": float(best[k]) for k in MU_TAU if isinstance(best.get(k), (int, float))})
    return out


def best_line(spec: specs.SweepSpec, records: dict, generated: int, bests: list[dict] | None = None) -> str | None:
    """``best rel <v> at mu=<m> tau=<t>; <S> samples generated`` for a sweep with one (mu, tau) search
    (`best_trials`); with several, one line per search, ``best rel <v> at mu=<m> tau=<t> (budget=128)`` naming what
    tells it from the others, the last one ending ``; <S> samples generated (all searches)``. None for a sweep with
    no search (Fig. 4's per-metric mus). S counts every sample any trial generated, those of trials a scheduler
    stopped included."""
    bests = best_trials(spec, records) if bests is None else bests
    if not bests:
        return None
    lines = []
    for best in bests:
        among = f" ({best['search']})" if best["search"] else ""
        if best["trial_id"] is None:
            if best["metric"] == REL and search.BASELINE_ID not in records:  # (a spec with `baseline: false`)
                lines.append(f"no Rel. to rank the (mu, tau) search{among} by: the sweep has no unpruned trial "
                             "(baseline: false); its scores are in the table above")
            else:
                lines.append(f"no trial varying mu or tau{among} finished with {best['metric']}")
            continue
        value = records[best["trial_id"]]["metrics"][best["metric"]]  # the trial's own (the interval's centre too)
        where = " ".join(f"{k}={best.get(k) if best.get(k) is not None else 'default'}" for k in MU_TAU)
        lines.append(f"best {best['metric']} {value:.4f} at {where}{among}")
    lines[-1] += f"; {generated} samples generated" + (" (all searches)" if len(bests) > 1 else "")
    return "\n".join(lines)


def paired_lines(spec: specs.SweepSpec, records: dict) -> list[str]:
    """Each method's Rel. difference to the best other method at its budget with a paired bootstrap interval
    (`pipelines.reporting.paired`; the spec's `bootstrap` resamples), for the console below the summary table: which
    gaps in it are noise. Budgets descending, then the spec's trial order (the same lines in the same order on every
    run, whichever trial finished first); ties of Rel. broken as in the report (`paired.differences`), whatever the
    rows' order. Empty without `bootstrap`, a finished baseline, or two methods at a budget."""
    base = records.get(search.BASELINE_ID)
    if not spec.bootstrap or base is None or base["predictions"] is None:
        return []
    from pipelines.reporting import paired

    done = {tid: rec for tid, rec in in_spec_order(spec, records).items()
            if rec["error"] is None and not rec.get("stopped") and rec["predictions"] is not None}
    frame = pd.DataFrame({"method": [rec["trial"]["method"] or mlflow_layout.BASELINE_METHOD for rec in done.values()],
                          "budget": [rec["trial"]["budget"] for rec in done.values()],
                          "rel": [rec["metrics"].get(REL, math.nan) for rec in done.values()]}, index=list(done))
    diffs = paired.differences(frame, search.BASELINE_ID, lambda tid: paired.rows_from(done[tid]["predictions"]),
                               iters=spec.bootstrap)
    if not diffs:
        return []
    return ([f"Rel. differences, each method against the best other at its budget (95% paired bootstrap over the "
             f"documents, {spec.bootstrap} resamples; [interval] holding 0: not told apart):"]
            + [f"  {d.budget:.0f} tokens: {d.text()}" for d in diffs])
