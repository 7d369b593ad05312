"""How close each decision of the float64 quickstart comes to going the other way: its decision margins.

    python benchmarks/decision_margins.py                               # sweeps/quickstart.yaml at full size
    python benchmarks/decision_margins.py --limit 4 --calibration-n 8   # a check of the script (smoke)

The quickstart (``sweeps/quickstart.yaml``: ``testbed:llava`` in float64, its trials, budgets, tasks, questions and
calibration images; ``--spec`` / ``--set`` another spec of the same methods) runs here as its model workers run it:
mu calibrated by ``pipelines.calibration.measure`` on the spec's calibration images, then every trial's questions
packed into the sweep's blocks (``pack_requests``, ``resources.batch_size``) and answered by ``run_requests`` with
the model wrapped as a worker wraps it. Nothing in the library changes: the script wraps, in its own process,
``promprune.select`` (each call's inputs are replayed step by step here, and the replay must keep the tokens the
library kept, or the script fails) and the logits processor ``PrunedVLM`` adds to ``generate`` (it reads the scores
the greedy argmax ranks). Each row is the minimum over everything the quickstart decides, with where it occurred:

- greedy answers: the gap between the top two scores (the float32 copies of the float64 logits transformers ranks)
  at every generated token up to and including the row's EOS;
- PromPrune's saliency order (the min-max normalized saliency, sorted): adjacent scores at its cut ``t_sal`` (the
  only pair that decides its salient set) and over every adjacent pair, relative to the row's largest;
- VisPruner's saliency order (the pairs that decide: its cut at ``floor(T r)`` and the order of the rest, whose
  positions pair its tokens for duplicate removal) and its duplicate matches per round (the drop cut, and the
  survivors' order where another round follows), and each over every adjacent pair, relative to the row's largest;
- DivPrune's picks: its farthest-point steps count every score within ``FPS_TIE_EPS`` (1e-6) of the best as tied,
  the lowest index winning, so the margin is each other free token's distance to that line (best - 1e-6), relative
  to the best (the best itself is always 1e-6 above it);
- the DPP's picks (PromPrune's coverage stage): the best residual gain over the runner-up, relative to the best; its
  first pick (the token least like the salient ones: the smallest largest cosine to them) by the gap to the
  runner-up, in cosine; each chosen gain's factor above the ``GAIN_EPS`` floor (1e-6) below which it falls back;
- PromPrune's ``ratio x T``: its distance to the nearest rounding boundary (k + 0.5, in tokens);
- the calibrated median: its distance to the nearest boundary of its 4 printed decimals.

Exact ties (the DPP's first step without salient tokens, where every gain is the kernel's diagonal, exactly 1;
DivPrune's mutual nearest neighbours, exactly symmetric) are counted beside the table: they break by saliency or
index on every CPU. The last column is log10(margin / 1e-14): how many orders of magnitude the margin lies above
the ~1e-14 by which float64 results differ between CPUs' kernels (docs/testbed.md, "What still differs").
"""
from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags  # noqa: E402

SPEC = "sweeps/quickstart.yaml"
CROSS_CPU = 1e-14  # float64 results differ by about this between CPUs' kernels (docs/testbed.md)
METHODS = (None, "promprune", "divprune", "vispruner")  # the decisions this script replays
DECIMALS = 4  # the calibrated mu as the quickstart's table prints it
EVERY_PAIR = ("prom_all", "vis_sal_all", "vis_match_all")  # rows of pairs that may decide nothing: not "closest"

# the table's rows, in order: key -> (what is decided, the margin's unit)
ROWS = {
    "answer": ("greedy answers: top two scores", "logit"),
    "prom_cut": ("PromPrune saliency order: at its cut (t_sal)", "of row max"),
    "prom_all": ("PromPrune saliency order: every adjacent pair", "of row max"),
    "vis_sal": ("VisPruner saliency order: pairs that decide", "of row max"),
    "vis_sal_all": ("VisPruner saliency order: every adjacent pair", "of row max"),
    "vis_match": ("VisPruner duplicate matches: pairs that decide", "of row max"),
    "vis_match_all": ("VisPruner duplicate matches: every adjacent pair", "of row max"),
    "divprune": ("DivPrune picks: distance to the near-tie line", "of best"),
    "dpp": ("DPP picks: best gain over the runner-up", "of best"),
    "dpp_first": ("DPP first pick: runner-up (cosine to the salient)", "cosine"),
    "dpp_tie": ("DPP exact ties, broken by saliency: runner-up", "of max"),
    "dpp_floor": ("DPP gains: chosen gain over the 1e-6 floor", "factor"),
    "ratio": ("PromPrune ratio x T: distance to a rounding boundary", "tokens"),
    "median": (f"calibrated median: distance to its {DECIMALS}-decimal boundary", "mu"),
}


# ---------------------------------------------------------------------------------------------------------------------
# margins of one decision (plain numbers: the tests check them by hand)


def rounding_margin(value: float) -> float:
    """Distance of ``value`` to the nearest rounding boundary ``k + 0.5``: how far ``round(value)`` is from changing."""
    return abs(value - math.floor(value) - 0.5)


def decimal_margin(value: float, decimals: int = DECIMALS) -> float:
    """Distance of ``value`` to the nearest boundary of its ``decimals``-decimal rounding (0.24193329 at 4 decimals:
    0.24195 - 0.24193329 = 1.671e-5)."""
    return rounding_margin(value * 10 ** decimals) / 10 ** decimals


def adjacent_gaps(descending) -> list[float]:
    """``v[i] - v[i + 1]`` of values sorted high to low."""
    values = [float(v) for v in descending]
    return [a - b for a, b in zip(values, values[1:])]


@dataclass
class Closest:
    """The smallest margin seen for one kind of decision, where it occurred, how many were measured."""

    value: float = math.inf
    where: str = ""
    count: int = 0

    def see(self, value: float, where) -> None:
        self.count += 1
        if value < self.value:
            self.value, self.where = float(value), where() if callable(where) else where


@dataclass
class Margins:
    """Every row's `Closest`, and the exact ties met (by kind)."""

    rows: dict = field(default_factory=lambda: {key: Closest() for key in ROWS})
    ties: dict = field(default_factory=dict)

    def see(self, key: str, value: float, where) -> None:
        self.rows[key].see(value, where)

    def see_all(self, key: str, values, where) -> None:
        """Each of ``values`` (``where(i)`` names the i-th)."""
        values = list(values)
        if not values:
            return
        i = min(range(len(values)), key=values.__getitem__)
        closest = self.rows[key]
        closest.count += len(values) - 1
        closest.see(values[i], lambda: where(i))

    def tie(self, kind: str) -> None:
        self.ties[kind] = self.ties.get(kind, 0) + 1


# ---------------------------------------------------------------------------------------------------------------------
# the selectors' decisions, replayed from a select call's inputs (one image at a time)


def ranking_margins(margins: Margins, key: str, all_key: str | None, values, decide: range, where) -> None:
    """Adjacent scores of a ranking sorted high to low (``values``), relative to its largest: the pairs
    ``(i, i + 1)`` for ``i`` in ``decide`` (those whose order changes what is kept) under ``key``, every pair under
    ``all_key``."""
    top = max(abs(float(values[0])), 1e-300) if len(values) else 1.0
    gaps = [g / top for g in adjacent_gaps(values)]
    if all_key is not None:
        margins.see_all(all_key, gaps, lambda i: where(f"positions {i}, {i + 1}"))
    chosen = [i for i in decide if 0 <= i < len(gaps)]
    margins.see_all(key, [gaps[i] for i in chosen], lambda k: where(f"positions {chosen[k]}, {chosen[k] + 1}"))


def replay_promprune(margins: Margins, tokens, budget: int, opts: dict, b: int, where) -> set[int]:
    """PromPrune's split, saliency stage and DPP coverage stage for row ``b``: its kept tokens, each decision's
    margin recorded."""
    import torch

    from promprune.selection.budget import saliency_ratio, split_budget
    from promprune.selection.kernels import ranks_to_mask, stable_descending_order
    from promprune.selection.two_stage import minmax, prominence

    entropy = prominence(tokens, "spectral")[b:b + 1]
    ratio_range = tuple(float(v) for v in opts["saliency_ratio_range"])
    share = float(saliency_ratio(entropy, opts["mu"], opts["tau"], ratio_range)[0]) * budget
    margins.see("ratio", rounding_margin(share), lambda: where(f"ratio x T = {share:.4f}"))
    t_sal = int(split_budget(entropy, budget, mu=opts["mu"], tau=opts["tau"], ratio_range=ratio_range,
                             rounding=opts["rounding"])[0])
    normalized = minmax(tokens.saliency[b:b + 1])
    order = stable_descending_order(normalized)[0]
    values = normalized[0, order]
    cut = range(t_sal - 1, t_sal) if 0 < t_sal < tokens.n else range(0)  # the salient set: only the cut decides
    ranking_margins(margins, "prom_cut", "prom_all", values, cut, lambda at: where(f"t_sal = {t_sal}, {at}"))
    anchor = ranks_to_mask(order[None], torch.tensor([t_sal]))[0]
    picks = replay_dpp(margins, tokens.cosine[b], ~anchor, budget - t_sal, anchor, tokens.saliency[b],
                       lambda at: where(f"t_sal = {t_sal}, {at}"))
    return set(order[:t_sal].tolist()) | set(picks)


def replay_dpp(margins: Margins, kernel, available, count: int, anchor, fallback, where) -> list[int]:
    """``diversity.dpp_greedy`` (unconditional, the released PromPrune code) on one image: its picks."""
    import torch

    from promprune.selection.diversity import GAIN_EPS

    n = kernel.shape[0]
    free = available.clone()
    gains = kernel.diagonal().clone()
    factor = kernel.new_zeros(count, n)
    first = None
    if bool(anchor.any()) and count:
        max_sim = kernel[:, anchor].amax(dim=1)
        max_sim = max_sim.masked_fill(kernel.diagonal() <= GAIN_EPS, torch.finfo(max_sim.dtype).max)
        ranked = max_sim.masked_fill(~available, math.inf)
        low = torch.sort(ranked, stable=True)
        first = int(low.indices[0])
        if int(available.sum()) > 1:
            margins.see("dpp_first", float(low.values[1] - low.values[0]),
                        lambda: where(f"tokens {first}, {int(low.indices[1])}"))
    picks = []
    for k in range(count):
        masked = gains.masked_fill(~free, -math.inf)
        best = float(masked.max())
        if k == 0 and first is not None:
            j, gain = first, float(gains[first])
        else:
            tied = free & (gains == best)
            if int(tied.sum()) > 1:  # exact tie: the saliency decides (``_argmax_tiebreak``)
                margins.tie("DPP steps with an exact tie (broken by saliency)")
                by_saliency = torch.sort(fallback.masked_fill(~tied, -math.inf), descending=True, stable=True)
                j = int(by_saliency.indices[0])
                top = max(abs(float(by_saliency.values[0])), 1e-300)
                margins.see("dpp_tie", float(by_saliency.values[0] - by_saliency.values[1]) / top,
                            where(f"DPP step {k}, tokens {j}, {int(by_saliency.indices[1])}"))
            else:
                ranked = torch.sort(masked, descending=True, stable=True)
                j = int(ranked.indices[0])
                if int(free.sum()) > 1:
                    margins.see("dpp", float(ranked.values[0] - ranked.values[1]) / best,
                                where(f"DPP step {k}, tokens {j}, {int(ranked.indices[1])}"))
            gain = best
        margins.see("dpp_floor", gain / GAIN_EPS if gain > GAIN_EPS else GAIN_EPS / max(gain, 1e-300),
                    where(f"DPP step {k}, token {j}, gain {gain:.3g}"))
        exhausted = gain <= GAIN_EPS
        if exhausted:  # the rest by saliency (``fallback``)
            j = int(torch.sort(fallback.masked_fill(~free, -math.inf), descending=True, stable=True).indices[0])
        picks.append(j)
        free[j] = False
        if not exhausted:
            e = kernel[j] - factor[:k, j] @ factor[:k]
            e = e / math.sqrt(max(gain, GAIN_EPS))
            factor[k] = e
            gains = (gains - e * e).clamp(min=0)
    return picks


def replay_divprune(margins: Margins, tokens, budget: int, b: int, where) -> set[int]:
    """DivPrune's farthest-point picks (``diversity.farthest_point``, no anchor) on row ``b``."""
    import torch

    from promprune.selection.diversity import FPS_TIE_EPS

    distance = (1.0 - tokens.cosine[b]).clamp_min(0)
    n = distance.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    score = distance.masked_fill(eye, math.inf).amin(dim=1)  # the first pick: the most isolated token
    nearest = torch.full((n,), math.inf, dtype=distance.dtype)
    free = torch.ones(n, dtype=torch.bool)
    picks = []
    for k in range(budget):
        scores = score if k == 0 else nearest
        masked = scores.masked_fill(~free, -math.inf)
        best = float(masked.max())
        line = best - FPS_TIE_EPS
        j = int(torch.nonzero(masked >= line)[0])
        if int((masked == best).sum()) > 1:
            margins.tie("DivPrune steps with an exact tie (the lower index wins)")
        others = free & (scores != best)  # the best itself stays on its side of the line: line = best - 1e-6
        away = (scores[others] - line).abs() / best
        candidates = torch.nonzero(others)[:, 0]
        if away.numel():
            i = int(away.argmin())
            margins.see("divprune", float(away[i]),
                        where(f"DivPrune step {k}, token {int(candidates[i])} (picked {j})"))
        picks.append(j)
        free[j] = False
        nearest = torch.minimum(nearest, distance[j])
    return set(picks)


def replay_vispruner(margins: Margins, tokens, budget: int, opts: dict, b: int, where) -> set[int]:
    """VisPruner's saliency stage and duplicate removal (``baselines.vispruner``) on row ``b``."""
    import torch

    from promprune.selection.baselines import VISPRUNER_ROUND
    from promprune.selection.kernels import stable_descending_order

    t_imp = int(budget * float(opts["important_ratio"]))
    saliency = tokens.saliency[b:b + 1]
    order = stable_descending_order(saliency)[0]
    keep = budget - t_imp
    # the rest's order pairs its tokens for duplicate removal; without a round only the cut decides
    rounds = keep > 0 and tokens.n - t_imp > keep
    decide = range(max(t_imp - 1, 0), tokens.n - 1) if rounds else range(t_imp - 1, t_imp)
    ranking_margins(margins, "vis_sal", "vis_sal_all", saliency[0, order], decide, lambda at: where(f"saliency {at}"))
    kernel = tokens.vision_cosine[b] if tokens.vision is not None else tokens.cosine[b]
    rest = order[t_imp:]
    step = 0
    while keep > 0 and rest.shape[0] > keep:
        drop = min(VISPRUNER_ROUND, rest.shape[0] - keep)
        even, odd = rest[0::2], rest[1::2]
        match = kernel[even][:, odd].amax(dim=1)
        ranked = stable_descending_order(match[None])[0]
        last = rest.shape[0] - min(drop, even.shape[0]) <= keep  # the last round: only its cut decides
        if drop < even.shape[0]:  # some evens survive: the cut decides, and their order where a round follows
            decide = range(drop - 1, drop) if last else range(drop - 1, even.shape[0] - 1)
            ranking_margins(margins, "vis_match", "vis_match_all", match[ranked], decide,
                            lambda at, s=step: where(f"round {s}, matches {at}"))
        rest = torch.cat([even[ranked[min(drop, even.shape[0]):]], odd])
        step += 1
    return set(order[:t_imp].tolist()) | set(rest[:max(keep, 0)].tolist())


# ---------------------------------------------------------------------------------------------------------------------
# the hooks: promprune.select and the logits PrunedVLM's generate ranks, wrapped in this process only


class Recorder:
    """What the quickstart is deciding now (trial, block, batch), and the margins of everything it decided."""

    def __init__(self):
        self.margins = Margins()
        self.trial = None  # a trial id while a trial's questions run; None: record nothing (the calibration)
        self.labels: dict = {}  # (image key, prompt) -> "task doc N"
        self.by_image: dict = {}  # image key -> "task doc N[, ...]"
        self.seen: set = set()  # images selected in the current block (its cache holds them)
        self.rows: list[str] = []  # the images the next select call's rows are
        self.steps: list = []  # per generated token: the top-two score gap of every row

    def block(self, requests) -> None:
        self.labels = {(r.image_key, r.prompt): f"{r.task} doc {r.doc_id}" for r in requests}
        self.by_image = {}
        for r in requests:
            self.by_image.setdefault(r.image_key, []).append(f"{r.task} doc {r.doc_id}")
        self.seen = set()

    def where(self, label: str, detail: str) -> str:
        return f"{self.trial}, {label}: {detail}"

    def selected(self, method: str, tokens, budget: int, opts: dict, sel) -> None:
        """Replay a select call's decisions row by row; its kept tokens must be the library's."""
        labels = self.rows if len(self.rows) == tokens.batch else [f"select row {b}" for b in range(tokens.batch)]
        for b in range(tokens.batch):
            def where(detail, b=b):
                return self.where(labels[b], detail)
            if method == "promprune":
                kept = replay_promprune(self.margins, tokens, budget, opts, b, where)
            elif method == "divprune":
                kept = replay_divprune(self.margins, tokens, budget, b, where)
            else:
                kept = replay_vispruner(self.margins, tokens, budget, opts, b, where)
            library = set(sel.indices[b].tolist())
            if kept != library:
                raise RuntimeError(f"{self.where(labels[b], method)}: the replay kept {sorted(kept)}, the library "
                                   f"{sorted(library)}: the margins would not be those of its decisions")

    def answered(self, keys, prompts, generations, eos: set[int]) -> None:
        """Each row's greedy decisions up to and including its EOS."""
        for b, gen in enumerate(generations):
            ids = list(gen.token_ids or [])
            last = next((k for k, t in enumerate(ids) if t in eos), len(ids) - 1)
            label = self.labels.get((keys[b] if keys is not None else None, prompts[b]), f"batch row {b}")
            if last + 1 > len(self.steps):
                raise RuntimeError(f"{self.where(label, 'answer')}: {len(ids)} tokens, {len(self.steps)} scores seen")
            gaps = [float(self.steps[k][b]) for k in range(last + 1)]
            self.margins.see_all("answer", gaps,
                                 lambda k, label=label, text=gen.text: self.where(label, f"token {k} of {text!r}"))


def install(recorder: Recorder) -> None:
    """Wrap ``promprune.select`` and the logits processor ``PrunedVLM._generate`` adds, in this process."""
    from transformers import LogitsProcessor

    import promprune
    from promprune.models import vlm as vlm_module
    from promprune.selection.registry import TokenSet

    select, flagger, generate = promprune.select, vlm_module.nonfinite_flagger, vlm_module.PrunedVLM.generate
    own = set(inspect.signature(select).parameters)

    def recorded_select(features, saliency=None, *, budget, method="promprune", vision=None, **options):
        sel = select(features, saliency, budget=budget, method=method, vision=vision, **options)
        if recorder.trial is not None:
            from promprune.dtypes import upcast
            from promprune.selection.registry import _validate_vision

            spec = promprune.method_spec(method)
            # select's own arguments (its signature: a hand-kept list missed entropy_bounds, and every pruned
            # answer of the run failed) are no method options
            opts = spec.resolve({k: v for k, v in options.items() if k not in own}, budget=budget)
            opts.pop("order")
            x = upcast(features)
            tokens = TokenSet(x, upcast(saliency) if spec.needs_saliency else None,
                              _validate_vision(vision, x) if spec.reads_vision else None)
            recorder.selected(method, tokens, min(budget, tokens.n), opts, sel)
        return sel

    class Recording(LogitsProcessor):
        """The library's processor, and the top-two gap of the scores it is handed (the last processor: what the
        greedy argmax ranks)."""

        def __init__(self, inner):
            self.inner = inner

        @property
        def rows(self):
            return self.inner.rows

        def __call__(self, input_ids, scores):
            top = scores.topk(2, dim=-1).values
            recorder.steps.append((top[:, 0].double() - top[:, 1].double()).cpu())
            return self.inner(input_ids, scores)

    def recorded_generate(self, images, prompts, *, keys=None, **kwargs):
        if keys is not None:
            fresh = [k for k in dict.fromkeys(keys) if k not in recorder.seen]
            recorder.rows = [", ".join(recorder.by_image.get(k, [str(k)])) for k in fresh]
        else:
            recorder.rows = [recorder.labels.get((None, p), p) for p in prompts]
        recorder.steps = []
        out = generate(self, images, prompts, keys=keys, **kwargs)
        if keys is not None:
            recorder.seen.update(keys)
        if recorder.trial is not None:
            eos = self.model.generation_config.eos_token_id
            recorder.answered(keys, list(prompts), out, set(eos if isinstance(eos, list) else [eos]))
        return out

    promprune.select = recorded_select
    vlm_module.nonfinite_flagger = lambda: Recording(flagger())
    vlm_module.PrunedVLM.generate = recorded_generate


# ---------------------------------------------------------------------------------------------------------------------


def distance(key: str, value: float) -> float:
    """A row's margin as the distance a value must move to change the decision: the gain floor's factor ``f`` is
    ``|gain - 1e-6|`` (``(f - 1) 1e-6`` above the floor, ``(1 - 1 / f) 1e-6`` below it); the others are one."""
    if key != "dpp_floor":
        return value
    from promprune.selection.diversity import GAIN_EPS

    return (value - 1.0) * GAIN_EPS if value >= 1.0 else (1.0 - 1.0 / value) * GAIN_EPS


def orders_of(value: float) -> str:
    return f"{math.log10(value / CROSS_CPU):.1f}" if value > 0 else "-inf"


def orders(key: str, value: float) -> str:
    """The table's last column: log10 of the row's `distance` over ``CROSS_CPU``."""
    return orders_of(distance(key, value))


def check_trials(flags: Flags, spec_path: str, trials) -> None:
    """Every trial runs a method this script replays, with the options it replays."""
    for t in trials:
        if t.method not in METHODS:
            flags.add(f"--spec {spec_path}", f"trial {t.trial_id} runs {t.method}, whose decisions this script does "
                      f"not replay (it replays {', '.join(m for m in METHODS if m)} and the unpruned model); give a "
                      "spec of those, e.g. sweeps/quickstart.yaml")
        elif t.method == "promprune":
            o = t.options
            if o.get("metric", "spectral") != "spectral" or o.get("diversity", "dpp") != "dpp" \
                    or o.get("conditional", False) or o.get("rounding", "half_even") != "half_even":
                flags.add(f"--spec {spec_path}", f"trial {t.trial_id}: this script replays PromPrune with the "
                          "spectral metric, the unconditional DPP and half-even rounding (its defaults); drop the "
                          "other options")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=SPEC, help=f"the sweep spec whose decisions are measured (default {SPEC})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override, as sweep.py's")
    p.add_argument("--limit", type=int, default=None, help="questions per task (default: the spec's limit)")
    p.add_argument("--calibration-n", type=int, default=None, help="calibration images (default: the spec's)")
    args = p.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--limit", args.limit, 1, "questions per task", 100)
    flags.at_least("--calibration-n", args.calibration_n, 1, "calibration images", 500)
    flags.refuse()
    from pipelines import spec as specs

    overrides = list(args.set) + ([f"limit={args.limit}"] if args.limit is not None else []) \
        + ([f"calibration.n={args.calibration_n}"] if args.calibration_n is not None else [])
    try:
        spec = specs.load(args.spec, overrides)
    except specs.SpecError as exc:  # as the other spec readers: the spec's paragraph, exit 2, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trials = specs.expand(spec)
    check_trials(flags, args.spec, trials)
    flags.refuse()
    started = time.perf_counter()

    import torch

    from pipelines import calibration
    from pipelines.run.requests import build_rows
    from promprune.eval import run_requests, score
    from promprune.eval.requests import pack_requests
    from promprune.eval.tasks import PRIMARY_METRICS, lmms_eval_silenced
    from promprune.models import PrunedVLM

    recorder = Recorder()
    install(recorder)
    base = spec.model.load(method=None, budget=None)
    metrics = calibration.metrics_to_calibrate(trials)
    medians, note = {}, ""
    if metrics:
        budget = calibration.budget_of(trials)
        measured = calibration.measure(base, spec.model.options, spec.calibration, metrics, budget)
        medians = {m: r["median"] for m, r in measured.items()}
        shipped = calibration.shipped_results(calibration.settings(spec.model, spec.calibration, metrics, budget,
                                                                   on_gpu=False))
        note = " (none shipped for these settings)" if shipped is None else \
            " (the shipped calibration: the same)" if all(shipped[m]["median"] == v for m, v in medians.items()) \
            else f" (the shipped calibration differs: {[shipped[m]['median'] for m in medians]})"
        for m, v in medians.items():
            recorder.margins.see("median", decimal_margin(v), f"{m}: {v!r} on {measured[m]['n']} images")
    with lmms_eval_silenced():
        rows = build_rows(spec.tasks, spec.limit, spec.generation)
    blocks = pack_requests(rows, spec.resources.batch_size)
    dtype = str(base.model.dtype).removeprefix("torch.")
    print(f"# {args.spec}: {spec.model.pretrained} in {dtype}, {len(trials)} trials x {len(rows)} questions "
          f"({', '.join(spec.tasks)}) in {len(blocks)} blocks of <= {spec.resources.batch_size}; mu calibrated on "
          f"{spec.calibration.n} images of {spec.calibration.images}: "
          f"{', '.join(f'{m} {v!r}' for m, v in medians.items()) or 'none'}{note}\n")
    scores = []
    for trial in trials:
        trial = trial.with_calibration(medians)
        vlm = PrunedVLM(base.model, base.processor, method=trial.method, budget=trial.budget, **spec.model.options,
                        **trial.run_options)
        recorder.trial = trial.trial_id
        preds = []
        for block in blocks:
            recorder.block(block)
            with torch.inference_mode():
                preds += run_requests(vlm, block, batch_size=spec.resources.batch_size)
        recorder.trial = None
        got = score(preds)
        scores.append(f"{trial.trial_id} " + " ".join(f"{got[t][PRIMARY_METRICS[t][0]]:.4f}" for t in spec.tasks))
    print("answers (each task's primary metric, as the sweep's table): " + "; ".join(scores) + "\n")
    print(f"| decision | measured | closest margin | unit | log10(margin / {CROSS_CPU:g}) | where |")
    print("|---|---:|---:|---|---:|---|")
    for key, (what, unit) in ROWS.items():
        c = recorder.margins.rows[key]
        if not c.count:
            print(f"| {what} | 0 | - | {unit} | - | (not met) |")
            continue
        print(f"| {what} | {c.count} | {c.value:.3g} | {unit} | {orders(key, c.value)} | {c.where} |")
    ties = "; ".join(f"{kind}: {n}" for kind, n in sorted(recorder.margins.ties.items())) or "none"
    print(f"\nexact ties met: {ties}")
    closest = min((distance(k, c.value), ROWS[k][0]) for k, c in recorder.margins.rows.items()
                  if c.count and k not in EVERY_PAIR)
    print(f"closest decision: {closest[1]}, {closest[0]:.3g} ({orders_of(closest[0])} orders of magnitude above "
          f"{CROSS_CPU:g}); wall {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
