"""Checks of a sweep against the world it will run in, before Ray starts and before any MLflow run exists.

`specs.parse` checks a spec by itself (fields, types, methods and option values). `preflight(spec)` checks what the spec
names: that every task exists (lmms-eval's, an offline one, or in a directory of the spec's `include_path`, whose task
files must all be readable) and would load (its data found where lmms-eval will look, local data files holding the split
it evaluates, a task of one's own importing its code), that the model resolves (a factory name, a local checkpoint
directory, a hub id in the cache or on a reachable hub) to one the adapters run (a registered family's config, with the
family's processor and a chat template), that every budget prunes (stays below the visual tokens the model gives an
image), that a task certain to give clips has a model that takes them (``check_video``), that every in-LLM trial can
prune this model's LLM at its layers (``promprune.models.llm_hooks.stage_layers``: a stage ranks at a full-attention
layer, not a hybrid LLM's linear-attention layers nor a sliding-window one; Gemma 4's E2B / E4B are refused) and at its
budget where the model's image gives a known count (``check_construction``) and decode with the generation settings
each task will use (one beam: ``check_generation``), that the MLflow store answers and can be
written, and that every ``PROMPRUNE_*`` environment variable is one PromPrune reads, with a value it takes
(``environment``). All problems come back together, in seconds; the entry scripts print them as one message without a
traceback. The model checks try every trial known before the sweep and, with ``tune.search: optuna``, the corners of
its search spaces (every listed value, each end of a range: ``specs.search_corners``), which it may sample; they load
the model's config and processor once (``factories.loads_once``). pipelines/fig2_concentration.py runs the same
`preflight` on the one trial it runs, less the checks of scoring (``evaluates=False``).

Some problems are this machine's, not the spec's (`NotOnThisMachine`): a hub dataset or model that is not in this
machine's cache while it is offline, task data or calibration images not where they are named. A sweep refuses
them like any other; `--validate-only` checks the spec, so it names them as warnings (the cluster that runs the
sweep may have the data) and passes.
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from promprune.env import temporary_env

from pipelines import mlflow_layout, paths
from pipelines.console import say
from pipelines.calibration import check_source, metrics_to_calibrate
from pipelines.environment import check_environment
from pipelines.spec import SpecError, SweepSpec, expand, search_corners, space
from pipelines.spec.errors import unknown


def preflight(spec: SweepSpec, *, tracking_uri: str | None = None, store: bool = True, trials: list | None = None,
              budgets_of: dict[str, int] | None = None, evaluates: bool = True) -> list[str]:
    """Every problem found, one message each (empty: good to go); ``store``: check the MLflow store too (an
    evaluation printing its results only needs none). ``trials`` / ``budgets_of``: what runs on the spec's model
    (default: the spec's trials, `spec_trials`, and their budgets, `budgets`); ``evaluates``: the trials answer the
    tasks and are scored as lmms-eval scores them (the limit's question pairs, the tasks' LLM judges, clips the model
    must take, ``tune.metric``, the search's package, the calibration images); pipelines/fig2_concentration.py
    measures entropies on the tasks' images and scores nothing, so it runs the other checks (``False``). The model's
    config and processor are loaded once for all the checks (``factories.loads_once``)."""
    from promprune.models.factories import loads_once

    errors, notes = check_environment()
    for note in notes:
        say(note)
    trials = spec_trials(spec) if trials is None else trials
    kinds = _video_kinds(spec) if evaluates else {}
    with loads_once():
        task_errors = check_tasks(spec.tasks, spec.limit if evaluates else None, spec.include_path)
        errors += task_errors
        errors += check_judges(spec.tasks) if evaluates else []
        errors += check_model(spec.model.pretrained, spec.model.options,
                              budgets(spec) if budgets_of is None else budgets_of,
                              clips=bool(kinds), in_llm=in_llm_budgets(spec))
        errors += check_video(spec, kinds) if evaluates else []
        errors += check_construction(spec, trials)
        errors += check_in_llm_layers(spec, trials)
        errors += check_clip_text(spec, trials)
        errors += check_attention(spec, trials)
    if evaluates:
        errors += [] if task_errors else check_generation(spec, trials)  # (the tasks' own kwargs: they must load)
        errors += check_metric(spec.tune.metric, spec.tasks, spec.include_path)
        errors += check_search_package(spec.tune.search)
    errors += check_store(tracking_uri or mlflow_layout.tracking_uri()) + check_experiment_name() if store else []
    if evaluates and metrics_to_calibrate(expand(spec)):
        problem = check_source(spec.calibration.images, spec.calibration.n)
        errors += [problem] if problem else []
    return errors


def spec_trials(spec: SweepSpec) -> list:
    """The trials the model's checks try: every trial known before the sweep (`expand`) and, for ``tune.search:
    optuna``, the trials at the corners of its search spaces (`specs.search_corners`), which it may sample."""
    known = expand(spec)
    ids = {t.trial_id for t in known}
    return known + [t for t in search_corners(spec) if t.trial_id not in ids]


def _who(ids: list[str], spec: SweepSpec) -> str:
    """`` (trials a, b)`` naming ``ids``, those optuna may sample (`specs.search_corners`) as such."""
    drawn = {t.trial_id for t in search_corners(spec)} - {t.trial_id for t in expand(spec)}
    listed, sampled = [i for i in ids if i not in drawn], [i for i in ids if i in drawn]
    parts = [f"trial{'s' if len(listed) > 1 else ''} {', '.join(listed)}"] if listed else []
    if sampled:
        parts.append(f"optuna may sample {', '.join(sampled)}, at a corner of the grid's search spaces")
    return f" ({'; '.join(parts)})"


def check_or_raise(spec: SweepSpec, source: str, *, tracking_uri: str | None = None, store: bool = True,
                   spec_only: bool = False) -> list[str]:
    """Raise SpecError with every problem (``store``: the MLflow store's too); ``spec_only`` (`--validate-only`):
    every problem but those of this machine (`NotOnThisMachine`), which come back as warnings."""
    from promprune.eval.task_checks import NotOnThisMachine

    problems = preflight(spec, tracking_uri=tracking_uri, store=store)
    warnings = [e for e in problems if spec_only and isinstance(e, NotOnThisMachine)]
    errors = [e for e in problems if not (spec_only and isinstance(e, NotOnThisMachine))]
    if errors:
        raise SpecError(errors, source)
    return warnings


def _labelled(label: str, problem: str) -> str:
    """``problem`` under a field's label, of the same kind (a `NotOnThisMachine` stays one)."""
    return type(problem)(f"{label}: {problem}")


def task_names(typed: list[str]) -> list[str]:
    """A command line's ``--tasks``: space- and/or comma-separated names (``a b``, ``a,b`` as lmms-eval takes them,
    ``a, b``), in order, blanks dropped."""
    return [name.strip() for item in typed for name in item.split(",") if name.strip()]


def check_tasks(tasks: list[str], limit: int | None = None, include_path: list[str] | None = None) -> list[str]:
    """Every task is lmms-eval's, an offline one or in a directory of ``include_path`` (each must exist, and every
    task YAML there must be readable: lmms-eval reads them all), ``limit`` can score it, and it would load here: its
    data is where lmms-eval and ``datasets`` will look (a relative ``data_files`` path resolved as lmms-eval does)
    and, local, has the split the task evaluates, and a task of one's own imports its ``!function`` code
    (`promprune.eval.task_checks`)."""
    from promprune.eval.task_checks import TaskFileError, task_problems
    from promprune.eval.tasks import check_limit, env_include_paths, task_manager

    missing = [f"include_path: {p} is not a directory (relative paths in a spec are from its directory)"
               for p in include_path or [] if not Path(p).is_dir()]
    if missing:
        return missing
    try:
        manager = task_manager(list(tasks), list(include_path or []))
    except TaskFileError as exc:
        return [f"include_path: {problem}" for problem in exc.problems]
    except ValueError as exc:
        return [f"tasks: {exc}"]
    problems = [f"limit: {problem}" for problem in (check_limit(t, limit) for t in tasks) if problem]
    own = [*(include_path or []), *env_include_paths()]
    return problems + [_labelled("tasks", problem) for problem in task_problems(manager, list(tasks), own)]


def task_generation(spec: SweepSpec, task: str) -> dict:
    """The generation settings ``task`` runs with: its lmms-eval ``generation_kwargs`` (from the spec's
    ``include_path`` too), the spec's ``generation`` over them."""
    from promprune.eval.tasks import task_config

    own = task_config(task, spec.include_path).get("generation_kwargs") or {}
    return {**own, **spec.generation}


def check_generation(spec: SweepSpec, trials: list | None = None) -> list[str]:
    """The spec's `generation` laid over each task's own lmms-eval generation_kwargs can be generated with
    (`promprune.eval.generation.sampling_problem`: do_sample over a task's temperature 0 failed every sample), and by
    every trial's method (``trials``: default the spec's, `spec_trials`): the kwargs each task hands ``generate``
    (`promprune.eval.generation.generate_kwargs`) pass `promprune.models.vlm.check_generation_kwargs` for the method,
    the rule ``PrunedVLM`` refuses every call with (an in-LLM method runs one beam: ``num_beams: 2`` passed
    --validate-only, then every sample of every in-LLM trial failed). A field `generate_kwargs` cannot read
    (`promprune.eval.generation.unreadable_generation`, the rule the lmms-eval plugin refuses with: ``num_beams: x``,
    a task's ``max_new_tokens: lots``) is refused too: it passed --validate-only, then failed every sample. One
    paragraph per problem, naming the field, where it is set (the spec's `generation` or the task's own
    generation_kwargs), the fix, the tasks and the trials."""
    from promprune.eval.generation import sampling_problem, unreadable_generation

    found: dict[str, list[str]] = {}
    merged = {task: {k: v for k, v in task_generation(spec, task).items() if v is not None} for task in spec.tasks}
    for task, kwargs in list(merged.items()):
        unreadable = unreadable_generation(kwargs)
        for key, error in unreadable.items():
            found.setdefault(_unreadable_problem(key, kwargs.get(key), error, spec.generation), []).append(task)
        merged[task] = {k: v for k, v in kwargs.items() if k not in unreadable}  # the rest, judged below
        problem = sampling_problem(merged[task])
        if problem:
            found.setdefault(problem, []).append(task)
    out = [f"generation: {problem} (tasks {', '.join(tasks)})" for problem, tasks in found.items()]
    refused: dict[str, tuple[list[str], list[str]]] = {}
    for trial in spec_trials(spec) if trials is None else trials:
        for task, kwargs in merged.items():
            problem = _method_generation_problem(trial.method, kwargs, spec.generation)
            if problem:
                tasks, ids = refused.setdefault(problem, ([], []))
                tasks += [task] if task not in tasks else []
                ids += [trial.trial_id] if trial.trial_id not in ids else []
    return out + [f"generation: {problem} (tasks {', '.join(tasks)}; {_who(ids, spec)[2:-1]})"
                  for problem, (tasks, ids) in refused.items()]


def _unreadable_problem(key: str, value, error: str, spec_generation: dict) -> str:
    """The paragraph refusing a generation field `generate_kwargs` cannot read (`unreadable_generation`'s ``key``,
    its ``value`` and ``error``), with where it is set (the spec's `generation` or the task's own generation_kwargs)
    and the fix."""
    wanted = "a stop string or a list of them" if key == "until" else "a number"
    if key in spec_generation:
        fix = f"the spec's generation.{key} sets it: give it {wanted}"
    else:
        fix = (f"the task's own generation_kwargs (its lmms-eval YAML) set it: set generation.{key} in the spec to "
               f"{wanted} (it overrides a task's), or correct the task's YAML")
    return (f"{key} {value!r} cannot be read for generate ({error}), so every sample asking it would "
            f"fail. {fix[0].upper()}{fix[1:]}")


def _method_generation_problem(method: str | None, gen_kwargs: dict, spec_generation: dict) -> str | None:
    """Why ``method`` cannot generate with a task's generation kwargs ``gen_kwargs`` (the spec's ``spec_generation``
    over the task's own), as ``PrunedVLM`` refuses them (`promprune.models.vlm.check_generation_kwargs`, on what
    `generate_kwargs` hands ``generate``), with where the offending field is set and how to fix it; None if it can.
    Kwargs `generate_kwargs` cannot read are not judged here (they fail there, every method alike)."""
    from promprune.eval.generation import generate_kwargs
    from promprune.models.vlm import check_generation_kwargs

    def refusal(kwargs: dict) -> str | None:
        try:
            check_generation_kwargs(method, kwargs)
        except ValueError as exc:
            return str(exc)
        return None

    try:
        kwargs, _ = generate_kwargs(gen_kwargs)
    except (TypeError, ValueError, OverflowError):
        return None
    problem = refusal(kwargs)
    if problem is None:
        return None
    fields = [k for k in kwargs if refusal({o: v for o, v in kwargs.items() if o != k}) is None]
    spec_set = [k for k in fields if k in spec_generation]
    task_set = [k for k in fields if k not in spec_generation]
    where = ([f"the spec's generation.{', generation.'.join(spec_set)} sets it: change that"] if spec_set else []) + (
        [f"the task's own generation_kwargs (its lmms-eval YAML) set {', '.join(task_set)}: set generation."
         f"{', generation.'.join(task_set)} in the spec, which overrides a task's"] if task_set else [])
    fix = "; ".join(where) or "change the spec's generation"
    return f"{problem.rstrip('.')}. {fix[0].upper()}{fix[1:]}, or run these trials with a pre-LLM method"


JUDGE_PROBE_TIMEOUT_S = 15.0  # one short request; lmms-eval's own judge would retry for minutes per document


def judge_notes(tasks: list[str]) -> list[str]:
    """Console notes for judge-scored tasks that will be skipped for want of an API key."""
    from promprune.eval.tasks import judge_skip_reason

    return [f"note: {reason}" for reason in (judge_skip_reason(t) for t in tasks) if reason]


def check_judges(tasks: list[str]) -> list[str]:
    """Every judge-scored task that will run (its key is set) has a judge that answers one request now, through
    the client lmms-eval's judge itself builds from the environment: a wrong endpoint or key stops the sweep in
    seconds instead of costing minutes of retries per document and scoring answers 0."""
    from promprune.eval.tasks import JUDGE_TASKS, align_judge_endpoint, judge_skip_reason

    judged = [t for t in tasks if t in JUDGE_TASKS and judge_skip_reason(t) is None]
    if not judged:
        return []
    problem = align_judge_endpoint()
    if problem:
        return [f"judge: {problem}"]
    error = probe_judge()
    return [f"judge: {', '.join(judged)} {error}"] if error else []


def probe_judge() -> str | None:
    """Send the judge one tiny chat request; None when it answered, else what went wrong and what to set."""
    from lmms_eval.llm_judge import ServerConfig, get_server

    from promprune.eval.tasks import api_key_env, api_type

    model = os.environ.get("MODEL_VERSION", "gpt-4o-2024-11-20")  # lmms-eval MM-Vet's judge model and its default
    try:
        server = get_server(server_name=api_type(), config=ServerConfig(model_name=model, max_tokens=4))
        client = server.client.with_options(timeout=JUDGE_PROBE_TIMEOUT_S, max_retries=0)
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Reply with: 1"}],
                                       max_tokens=4, temperature=0)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe is the user's to fix; reported with its cause
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:240]
        where = (f"AZURE_ENDPOINT={os.environ.get('AZURE_ENDPOINT', '')!r}" if api_type().startswith("azure") else
                 f"OPENAI_BASE_URL / OPENAI_API_URL={os.environ.get('OPENAI_API_URL') or 'unset (api.openai.com)'}")
        return (f"is scored by an LLM judge that did not answer a test request ({type(exc).__name__}: {first}). "
                f"The judge is reached at {where} with the key in {api_key_env()}, model {model!r} (MODEL_VERSION). "
                f"Point the endpoint at a live OpenAI-compatible server and set a key it accepts, or unset "
                f"{api_key_env()} to skip the judge-scored task(s)")
    return None


def check_concentration_judge(judge) -> list[str]:
    """The Fig. 2 judge (a ``pipelines.judge.ConcentrationJudge``) answers one request about a small image now, with
    no retries: a dead endpoint, a URL that is no API root, a refused key or an unknown model stops the figure in
    seconds instead of a minute of retries per image."""
    from pipelines.judge import JudgeAuthError

    error = judge.probe(JUDGE_PROBE_TIMEOUT_S)
    if error is None:
        return []
    if isinstance(error, JudgeAuthError):  # its message names the key's variable and the endpoint's settings
        return [f"judge: {error}"]
    where = "AZURE_ENDPOINT (or --judge-base-url)" if judge.azure else "--judge-base-url (else OPENAI_BASE_URL)"
    return [f"judge: a test request failed: {error}. Point {where} at the API root of a live OpenAI-compatible "
            f"server that serves the judge model {judge.model!r} (--judge-model), e.g. http://127.0.0.1:8000/v1, "
            f"with the key it accepts in {judge.key_env}"]


def budgets(spec: SweepSpec) -> dict[str, int]:
    """Every budget a trial may run, by where it comes from: the trials known before the sweep (by id), and the
    grid's budget values a search may choose (``grid.budget=<b>``)."""
    out = {t.trial_id: t.budget for t in expand(spec) if t.budget is not None}
    if spec.tune.search == "optuna" and "budget" in spec.grid:
        out |= {f"grid.budget={b}": b for b in space.parse(spec.grid["budget"]).corners if isinstance(b, int)}
    return out


def in_llm_budgets(spec: SweepSpec) -> frozenset[str]:
    """The keys of `budgets` an in-LLM method runs (whose budget counts the prompt's image placeholders, newline
    tokens included): its trials, and a search's grid budgets where every method of the grid is one."""
    from promprune.models.options import is_in_llm

    out = {t.trial_id for t in expand(spec) if t.budget is not None and is_in_llm(t.method)}
    methods = spec.grid.get("method")
    if isinstance(methods, list) and methods and all(is_in_llm(m) for m in methods):
        out |= {key for key in budgets(spec) if key.startswith("grid.budget=")}
    return frozenset(out)


def check_search_package(search: str) -> list[str]:
    """``tune.search: optuna`` needs the optuna package (the `pipeline` extra pins it)."""
    if search != "optuna":
        return []
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        return ["tune.search: optuna needs the optuna package, which is not installed here (it is in the pipeline "
                "extra: pip install -c constraints.txt -e '.[pipeline]'), or use tune.search: random"]
    return []


def check_metric(metric: str, tasks: list[str], include_path: list[str] | None = None) -> list[str]:
    """``tune.metric``: rel, or a metric its task reports (its lmms-eval ``metric_list``; ``include_path``: the
    spec's task directories, where a task of one's own is). A task that is not found here is `check_tasks`'s problem,
    not one more here."""
    from promprune.eval.tasks import task_config

    if metric == "rel" or metric.split("/")[0] not in tasks:  # a task not in the spec: `specs.parse` said so
        return []
    task, name = metric.split("/")
    try:
        config = task_config(task, include_path)
    except ValueError:  # an unknown task (check_tasks names it) or one without a YAML: no metric_list to read
        return []
    names = [m["metric"] for m in config.get("metric_list") or [] if isinstance(m, dict)]
    if names and name not in names:
        return [f"tune.metric: {task} reports no metric {name!r}{unknown(name, names)}"]
    return []


def check_model(pretrained: str, adapter_options: dict, budgets: dict[str, int], clips: bool = False,
                in_llm: frozenset[str] = frozenset()) -> list[str]:
    """The model resolves to a config a registered family runs (``registry.family_of``: its ``model_type``, and for
    LLaVA a CLIP vision tower), a checkpoint's processor loads, is its family's and has a chat template
    (``adapters.checkpoint_processor``, as ``PrunedVLM.from_pretrained`` loads it), and every budget (by trial id) is
    below the visual tokens it gives one image (one problem per budget that is not, naming its trials): for the
    trials in ``in_llm`` (an in-LLM method's), the prompt's image placeholders, LLaVA-NeXT's / OneVision's newline
    tokens included (``adapters.visual_token_ceiling``), since those methods prune them too. ``clips``:
    some task may give clips (`_video_kinds`), which a budget above one image's tokens still prunes (a clip of
    several frames gives more): such a budget is then one console note (an image of those tasks runs unpruned), not
    a refusal."""
    from promprune.eval.task_checks import NotOnThisMachine
    from promprune.models.adapters import checkpoint_processor, model_capacities
    from promprune.models.factories import NotCachedError, find_model_factory, model_config

    try:
        capacities = dict(enumerate(model_capacities(pretrained, adapter_options)))  # {in-LLM?: its count}
        if find_model_factory(pretrained) is None:  # a checkpoint (a factory builds its processor in code)
            checkpoint_processor(pretrained, model_config(pretrained))
    except NotCachedError as exc:  # the budgets are checked where the model is
        return [NotOnThisMachine(f"model.pretrained: {exc}")]
    except ValueError as exc:
        return [f"model.pretrained: {exc}"]
    over: dict[tuple[int, int], list[str]] = {}
    for tid, budget in budgets.items():
        capacity = capacities[tid in in_llm]
        if capacity is not None and budget >= capacity:
            over.setdefault((budget, capacity), []).append(tid)
    out = []
    for (budget, capacity), tids in over.items():
        who, keep, it = ("trial", "keeps", "it") if len(tids) == 1 else ("trials", "keep", "they")
        image = "an image"
        if capacities[False] is not None and capacity != capacities[False]:  # an in-LLM method's count
            image += f" (its {capacity - capacities[False]} newline tokens included: in-LLM methods prune them too)"
        if clips:
            say(f"note: budget: {who} {', '.join(tids)} {keep} {budget} of the {capacity} visual tokens {pretrained} "
                f"gives {image}: clips of several frames still prune, but any image among the tasks' documents runs "
                f"unpruned")
            continue
        out.append(f"budget: {who} {', '.join(tids)} {keep} {budget} of the {capacity} visual tokens {pretrained} "
                   f"gives {image}, so {it} would run unpruned; use budgets below {capacity}")
    return out


def _config_for(spec: SweepSpec, needed) -> object | None:
    """The spec's model config for a check that has something to check (``needed``); None where it has nothing, or
    the config does not load (`check_model` says why) or is a factory's without one."""
    from promprune.models.factories import model_config

    if not needed:
        return None
    try:
        return model_config(spec.model.pretrained)
    except ValueError:
        return None


def _video_kinds(spec: SweepSpec) -> dict[str, str]:
    """The spec's tasks that may give clips, each with its ``tasks.video_task_kind`` ("clips": certain; "flagged":
    lmms-eval's ``dataset_kwargs.video``, decided at run time), from the tasks' YAML alone."""
    from promprune.eval.tasks import video_task_kind

    kinds = {}
    for task in spec.tasks:
        try:
            kind = video_task_kind(task, spec.include_path)
        except ValueError:
            continue  # check_tasks says why
        if kind:
            kinds[task] = kind
    return kinds


def check_video(spec: SweepSpec, kinds: dict[str, str] | None = None) -> list[str]:
    """The spec's video tasks run on a model whose family answers about clips (``Family.video``,
    ``video.check_video_config``): a model without (LLaVA, GLM-4.6V) failed every sample of such a task, and the sweep
    exited 0. Judged from the tasks' YAML alone (``tasks.video_task_kind``, no data loaded). A task certain to give
    clips (an offline video task, an MVBench task or another answered as clips by name, ``tasks.frames_are_clips``,
    or a group with one) is one problem naming the tasks and the model. A task that
    only sets lmms-eval's ``dataset_kwargs.video`` may give images (MixEval-X's image2text tasks, site_bench_image),
    so it is not refused: one console note names it, the model and what happens if its documents are clips. A false
    refusal would block valid work; a miss only records failed samples."""
    from promprune.models.video import check_video_config

    kinds = _video_kinds(spec) if kinds is None else kinds  # ``kinds``: the caller's `_video_kinds`, read once
    config = _config_for(spec, kinds)
    if config is None:
        return []
    try:
        check_video_config(config)
    except ValueError as exc:
        video = [t for t, kind in kinds.items() if kind == "clips"]
        flagged = [t for t, kind in kinds.items() if kind == "flagged"]
        model = spec.model.pretrained
        if flagged:
            which = f"task {flagged[0]} sets" if len(flagged) == 1 else f"tasks {', '.join(flagged)} set"
            say(f"note: {which} lmms-eval's dataset_kwargs.video, and model.pretrained {model!r} answers about images "
                f"only ({exc}). The flag only makes lmms-eval download its data archives: if the documents are "
                "images (MixEval-X's image2text tasks, site_bench_image) the task runs as any image task; if they "
                "are clips (Video-MME), every sample fails (counted in n_failed). This is decided at run "
                "time, for each document from its visual")
        if video:
            which = f"task {video[0]} gives" if len(video) == 1 else f"tasks {', '.join(video)} give"
            return [f"tasks: {which} clips, and model.pretrained {model!r} is a model whose adapter answers about "
                    f"images only ({exc}): every sample would fail. Run the video tasks on a model of one of those "
                    "families, or drop them from tasks"]
    return []


def check_construction(spec: SweepSpec, trials: list | None = None) -> list[str]:
    """What the model's construction would refuse in every worker, after Ray started (a traceback, exit 1), found from
    the model's config and each trial's options alone (``vlm.construction_problems``, the code ``PrunedVLM`` runs):
    an adapter option the family cannot run this config with (a ``saliency_block`` that is no full-attention block of
    Qwen2.5-VL's tower, or past the tower's last layer), CDPruner's ``text_source: clip`` on a model without a CLIP
    tower, a ``view_quota`` budget (LLaVA-NeXT's released VisPruner / VisionZip / CDPruner layout) that gives each
    view nothing, an in-LLM budget whose schedule cannot prune any image the model takes (PyramidDrop's
    ``budget_semantics: released`` below the layer-averaged count of the layers before its first stage, at the fewest
    visual tokens every image gives; a model with no known floor is left to run time). One problem per distinct
    problem, under the field that set it, naming the trials unless every trial has it. A budget only the larger
    images fail (``vlm.larger_images_problem``) is one console note naming the trials: those images are failed
    samples. ``trials``: default the spec's (`spec_trials`: with
    optuna, the corners of its search spaces, so a sampled budget below a view's token is refused too)."""
    from pipelines.calibration import CALIBRATE
    from promprune.models.options import validate_method
    from promprune.models.vlm import construction_problems, larger_images_problem

    trials = spec_trials(spec) if trials is None else trials
    config = _config_for(spec, trials)
    if config is None:
        return []
    views = _views(spec.model.pretrained, config)
    found: dict[tuple[str, str], list[str]] = {}
    noted: dict[str, list[str]] = {}
    for trial in trials:
        given = {k: v for k, v in {**spec.model.options, **trial.options}.items() if v != CALIBRATE}
        try:
            method_options, adapter_options = validate_method(trial.method, trial.budget, **given)
            refused = construction_problems(config, trial.method, trial.budget, method_options, adapter_options,
                                            views)
            larger = None if refused else larger_images_problem(config, trial.method, trial.budget,
                                                                 method_options, adapter_options)
        except ValueError:
            continue  # specs.parse (the options) or check_model (a config no family runs) says why
        for problem in refused:
            found.setdefault((_field(getattr(problem, "option", None), trial, spec), str(problem)),
                             []).append(trial.trial_id)
        if larger is not None:
            noted.setdefault(larger, []).append(trial.trial_id)
    for larger, ids in noted.items():
        say(f"note: {larger}{'' if len(ids) == len(trials) else _who(ids, spec)}")
    out = []
    for (field, problem), ids in found.items():
        out.append(f"{field}: {problem}{'' if len(ids) == len(trials) else _who(ids, spec)}")
    return out


def _views(pretrained: str, config) -> int | None:
    """The most views one image of the model gives (``Adapter.views``): a checkpoint's from its processor, a
    factory's from its config where the family's count is the config's (None where it is the processor's)."""
    from promprune.models.factories import find_model_factory, model_processor
    from promprune.models.registry import family_of

    try:
        processor = None if find_model_factory(pretrained) is not None else model_processor(pretrained)
        return family_of(config).adapter.views(config, processor)
    except ValueError:
        return None  # check_model says why


def _field(option: str | None, trial, spec: SweepSpec) -> str:
    """The spec's field that gave ``trial`` its ``option`` (a trial's own: the grid's or the listed trials'; else the
    model's adapter options); ``budget`` is the trial's budget."""
    if option == "budget":
        return "budget"
    if option in trial.options:
        return f"grid.{option}" if option in spec.grid else f"trials.{option}"
    return "model.options" if option is None else f"model.options.{option}"


def check_clip_text(spec: SweepSpec, trials: list | None = None) -> list[str]:
    """CDPruner's trials that embed the question with a CLIP text tower (``text_source`` released on a CLIP-based
    model, or clip) can load that tower: adapter option ``clip_text``, else the model config's
    ``promprune_clip_text``, else the released openai/clip-vit-large-patch14-336. A tower this machine cannot load
    offline is a `NotOnThisMachine` problem naming the trials (a warning for ``--validate-only``, refused by a run),
    as the model itself is: every such sample failed, the run exiting 0. ``trials``: default the spec's
    (`spec_trials`)."""
    from promprune.eval.task_checks import NotOnThisMachine
    from promprune.models.clip_text import RELEASED_CLIP
    from promprune.models.factories import NotCachedError, model_config
    from promprune.models.registry import find_family

    trials = [t for t in (spec_trials(spec) if trials is None else trials) if t.method == "cdpruner"]
    config = _config_for(spec, trials)
    family = None if config is None else find_family(config)
    if family is None:
        return []
    towers: dict[str, list[str]] = {}
    for trial in trials:
        source = {**spec.model.options, **trial.options}.get("text_source", "released")
        if source == "clip" or (source == "released" and family.adapter.encoder == "clip"):
            name = spec.model.options.get("clip_text") or getattr(config, "promprune_clip_text", None) or RELEASED_CLIP
            if name != "tiny":
                towers.setdefault(name, []).append(trial.trial_id)
    out = []
    for name, ids in towers.items():
        who = _who(ids, spec)[2:-1]
        try:
            model_config(name)
        except NotCachedError as exc:
            out.append(NotOnThisMachine(f"model.options.clip_text: CDPruner's CLIP text tower for {who}: {exc}"))
        except ValueError as exc:
            out.append(f"model.options.clip_text: CDPruner's CLIP text tower for {who}: {exc}")
    return out


def check_in_llm_layers(spec: SweepSpec, trials: list | None = None) -> list[str]:
    """Every in-LLM trial can prune the spec's model at its layers (``llm_hooks.stage_layers`` on the model's config:
    a stage ranks at a full-attention layer of a hybrid LLM such as Qwen3.5 or a sliding-window one such as Gemma 4,
    and the LLM is one the hooks can prune), so a method the model cannot run is refused here, not in a Ray actor: one
    paragraph per distinct problem, naming the model, the method and the trials (``trials``: default the spec's,
    `spec_trials`)."""
    import promprune
    from promprune.models.llm_hooks import stage_layers
    from promprune.models.options import is_in_llm, validate_method

    trials = [t for t in (spec_trials(spec) if trials is None else trials) if is_in_llm(t.method)]
    config = _config_for(spec, trials)
    problems: dict[str, list[str]] = {}
    for trial in [] if config is None else trials:
        try:
            options, _ = validate_method(trial.method, trial.budget, **{**spec.model.options, **trial.options})
            resolved = promprune.method_spec(trial.method).resolve(options, budget=trial.budget)
            stage_layers(config, trial.method, resolved, spec.model.pretrained)
        except ValueError as exc:
            problems.setdefault(str(exc), []).append(trial.trial_id)
    return [f"{problem}{_who(ids, spec)}" for problem, ids in problems.items()]


def check_attention(spec: SweepSpec, trials: list | None = None) -> list[str]:
    """The model's dtype and LLM attention can run every trial on the plan's device, the checks ``PrunedVLM`` runs on
    the built model (`promprune.models.attention`), from the spec alone: float64 (``dtype: auto`` resolved as the
    run resolves it, `weights.resolve_dtype`: bfloat16 on GPU, float32 on CPU, so never refused) under ``eager``
    attention (NaN answers for the padded rows of a batch, recorded as empty successes); an in-LLM trial under an
    attention whose masks its hooks cannot write (every sample failed); ``flash_attention_2`` where it cannot run
    (`check_flash_attention`). ``trials``: default the spec's (`spec_trials`)."""
    from promprune.models.attention import in_llm_attention_problem, precision_problem

    from pipelines.weights import resolve_dtype

    attn = spec.model.attn_implementation
    out = []
    precision = precision_problem(resolve_dtype(spec.model.dtype, spec.resources.device == "gpu"), attn)
    if precision is not None:
        out.append(f"model.dtype / model.attn_implementation: {precision}")
    found: dict[str, list[str]] = {}
    for trial in spec_trials(spec) if trials is None else trials:
        problem = in_llm_attention_problem(trial.method, attn)
        if problem is not None:
            found.setdefault(problem, []).append(trial.trial_id)
    out += [f"model.attn_implementation: {problem}{_who(ids, spec)}" for problem, ids in found.items()]
    return out + check_flash_attention(attn, spec.resources.device)


def check_flash_attention(attn: str, device: str) -> list[str]:
    """``flash_attention_2`` runs: not on a CPU plan (``resources.device: cpu``), and where transformers finds
    flash-attn usable (``transformers.utils.is_flash_attn_2_available``: the package on a CUDA GPU). Without it, the
    sweep crashed after Ray started, each worker's load an ImportError traceback. A driver with a GPU tells for
    itself; one without (a cluster's CPU head node, where ``ray job submit`` runs the driver) cannot tell for the
    GPU workers: one console note, not a refusal, so a cluster whose workers have it runs."""
    if attn != "flash_attention_2":
        return []
    import importlib.util

    import torch
    from transformers.utils import is_flash_attn_2_available

    fix = "or set model.attn_implementation: sdpa (the default)"
    if device == "cpu":
        return [f"model.attn_implementation: flash_attention_2 runs on CUDA GPUs only, and resources.device is cpu, "
                f"so every worker would fail to load the model; run on GPUs (resources.device: gpu) {fix}"]
    if is_flash_attn_2_available():
        return []
    package = "installed" if importlib.util.find_spec("flash_attn") is not None else "not installed"
    if torch.cuda.is_available():
        return [f"model.attn_implementation: flash_attention_2 needs the flash-attn package, which transformers "
                f"cannot use on this machine's GPU (is_flash_attn_2_available() is False; flash_attn is {package}), "
                f"so every worker would fail to load the model with an ImportError; install flash-attn "
                f"(pip install flash-attn --no-build-isolation) {fix}"]
    say(f"note: model.attn_implementation: flash_attention_2 needs a CUDA GPU with the flash-attn package; this "
        f"machine has no GPU (flash_attn is {package} here), so it cannot tell whether the GPU workers that run the "
        f"sweep have it. Without it every worker fails to load the model; install flash-attn there {fix}")
    return []


def _fail_fast_http():
    """MLflow retries a dead server for minutes; a probe wants an answer in seconds (a server that is down refuses
    the connection at once; 15 s lets a live one on a busy head answer its first request)."""
    return temporary_env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="15")


def check_store(uri: str) -> list[str]:
    """The MLflow store at ``uri`` answers and, for a SQLite file, can be written. MLflow is imported only to open a
    store that exists (a new SQLite store is the directory's to take: the driver opens it while Ray starts)."""
    fix = ("set MLFLOW_TRACKING_URI to a store you can write (e.g. sqlite:///mlflow.db in a writable directory) or "
           "start the server it names (`mlflow server --backend-store-uri sqlite:///mlflow.db`)")
    if paths.in_ray_job():  # a relative store lands in Ray's package copy of the working directory, deleted by Ray
        fix = (f"set MLFLOW_TRACKING_URI in the job's --runtime-env-json to a store the head can write, by absolute "
               f"path (sqlite:////<absolute folder>/mlflow.db), or leave it unset (mlflow.db in ${paths.HOME_ENV}, "
               "default ~/promprune), or start the server it names")
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = mlflow_layout.sqlite_path(uri)
        if path is not None:
            if path.is_dir():  # MLflow's SQLAlchemy engine retried it for ~2 minutes before failing
                return [f"MLflow store {uri}: {path} is a directory, not a database file (e.g. {path}/mlflow.db); "
                        f"{fix}"]
            if path.parent.exists() and not path.parent.is_dir():  # passed os.access, then failed in MLflow's mkdir
                return [f"MLflow store {uri}: {path.parent} is a file, not a directory; {fix}"]
            if not path.parent.exists():
                return [f"MLflow store {uri}: the directory {path.parent} does not exist; {fix}"]
            # a test write (os.access says yes to root whatever the mode bits): the folder too, for an existing store
            # as for a new one, as SQLite makes its journal beside the database file (an existing store in a
            # read-only folder passed and the sweep failed after Ray started, a sqlite3 traceback)
            refused = paths.refuses_writes(path.parent)
            if refused:
                return [f"MLflow store {uri}: {path.parent} is not writable ({refused}: SQLite writes its journal "
                        f"beside the database file); {fix}"]
            refused = paths.refuses_file_writes(path) if path.exists() else None
            if refused:
                return [f"MLflow store {uri}: {path} is not writable ({refused}); {fix}"]
            if not path.exists():
                return []  # a new store: the directory takes it; checking by opening would create the file
    elif parsed.scheme in ("", "file"):
        return [f"MLflow store {uri}: plain file stores are refused by MLflow 3; {fix}"]
    from mlflow.tracking import MlflowClient

    try:
        with _fail_fast_http():
            MlflowClient(uri).search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any failure is reported with its cause
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        first = first if len(first) <= 240 else first[:240].rsplit(" ", 1)[0] + " ..."  # whole words
        return [f"MLflow store {uri} does not answer ({type(exc).__name__}: {first}); {fix}"]
    return []


def check_resumed_run(state: dict, uri: str | None = None) -> list[str]:
    """The MLflow parent run a ``--resume`` continues is in the store (``uri``, default the sweep's): a store deleted,
    or another ``MLFLOW_TRACKING_URI`` than the run's, gave MLflow's "Run ... not found" as a traceback after Ray
    started. A store that does not answer is left to the sweep (its writes wait in the outbox)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = uri or mlflow_layout.tracking_uri()
    database = mlflow_layout.sqlite_path(uri) if urlparse(uri).scheme == "sqlite" else None
    if database is None or database.exists():  # a SQLite file that is gone holds no run (opening it would make one)
        try:
            with _fail_fast_http():
                MlflowClient(uri).get_run(state["parent_run_id"])
            return []
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                return []
    started = state.get("tracking_uri")
    was = f" (the run was started with the store {started})" if started and started != uri else ""
    return [f"--resume {state['experiment']}: its MLflow parent run {state['parent_run_id']} is not in the store "
            f"{uri}{was}; set MLFLOW_TRACKING_URI to the store the run was started with, or run the sweep afresh "
            "without --resume (its saved blocks are then not reused)"]


def check_experiment_name(name: str | None = None) -> list[str]:
    """The MLflow experiment's name (``MLFLOW_EXPERIMENT_NAME``) is one MLflow takes: not empty, at most its 500
    characters (a longer one failed with MLflow's traceback after Ray started)."""
    name = mlflow_layout.experiment_name() if name is None else name
    most = 500  # mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH in MLflow 3
    if name.strip() and len(name) <= most:
        return []
    shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
    return [f"{mlflow_layout.EXPERIMENT_ENV}={shown}: MLflow takes an experiment name of 1 to {most} characters (a "
            f"blank one is refused here too); set one or unset it (default {mlflow_layout.DEFAULT_EXPERIMENT!r})"]


def random_weights_note(model: str) -> None:
    """Say so when a model has random weights: its scores are noise (0 on the offline tasks), by construction."""
    if model.startswith(("tiny:", "shape:")):
        say(f"note: {model} has random weights, so its answers and scores are noise (tiny-easyvqa:llava is trained "
            "offline and answers the easy-vqa tasks)")
