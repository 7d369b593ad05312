"""lmms-eval model plugin: ``lmms-eval --model promprune --model_args pretrained=...,method=promprune,budget=64``.

lmms-eval 0.7 discovers external models through the Python entry-point group ``lmms_eval.models``; each entry point
is a ``ModelManifest`` (or an iterable of them, or a callable returning one). This package's is ``MANIFEST`` below, a
callable returning the manifest:

    [project.entry-points."lmms_eval.models"]
    promprune = "promprune.eval.lmms_plugin:MANIFEST"

``--model_args`` keys: ``pretrained`` (checkpoint path/name or ``tiny:llava`` / ``tiny:llava_next`` /
``tiny:qwen2_5_vl``), ``method`` (a registered method; ``none`` for the unpruned model), ``budget``, ``dtype`` (auto
/ float16 / bfloat16 / float32 / float64 or an alias of ``promprune.dtypes.DTYPES``), ``device`` (cpu, cuda, cuda:1;
default: cuda when available; one this machine lacks is refused), ``attn_implementation`` (float64 needs ``sdpa``,
an in-LLM method ``sdpa`` or ``eager``: refused before loading, ``promprune.models.attention``), ``vision_once`` /
``prefix_cache`` (true / false, default false: each request is answered by itself, as lmms-eval's own models answer
it; true shares an image's encoding / prompt prefix between its questions, ``promprune.eval.generation``);
``enable_thinking`` (true / false; default: the chat template's own, Qwen3.5-4B thinks first as lmms-eval's qwen3_5
model does; its reasoning is dropped from the answer up to ``</think>``); any other key is a method option
(``mu=0.42,tau=0.02``). The prompt is the model's own chat template around lmms-eval's context, with any ``<image>``
tag in the context removed (``PrunedVLM.conversation``: the image goes where the template puts it, as lmms-eval's
Qwen and Gemma models do) (Qwen3.5 / Qwen3-VL: ChatML with the vision markers, and a system turn only with
``system_prompt=...``: lmms-eval's qwen3_vl / qwen3_5 models send "You are a helpful assistant.", which the
project's Qwen3 sweeps set). The batch size is lmms-eval's ``--batch_size`` (it passes ``batch_size`` to the model
itself; ``batch_size`` in ``--model_args`` is refused, naming that option). lmms-eval hands the model every request
of its run in one call: each request's image or clip is decoded as its batch is formed, so memory holds
``--batch_size`` of them, not the run's (``generate_until``).

Sampled answers (a task's or ``--gen_kwargs``' ``do_sample``) are seeded per request as the pipeline seeds them
(``generation.sample_seeds``): each request draws from its own random stream, seeded from lmms-eval's torch seed and
the request's identity (task, split, doc_id, the request's index in its document, and its repeat: the ``k``-th copy of
a request lmms-eval asks ``repeats`` times draws the ``k``-th stream), so its answer does not depend on
``--batch_size``, on the order lmms-eval hands the requests over, or on which requests share its batch. lmms-eval
gives a model no seed of its own: ``--seed`` (``simple_evaluate``'s ``torch_random_seed``, default 1234) seeds torch
just before lmms-eval constructs the model, so the seed is ``torch.initial_seed()`` when the model is constructed
(read before anything loads). Where lmms-eval leaves torch unseeded (``--seed 0,1234,None,1234``) that is torch's own
process seed, drawn at random per process: the answers then differ between runs, as transformers' sampling from an
unseeded torch would, but still not with the batch. A model constructed by the caller (``simple_evaluate(model=
PromPruneLMM(...))``, which seeds torch after the model exists) takes torch's seed at its construction. Sampled beam
search (``num_beams`` over 1) cannot draw per request: it keeps transformers' own sampling, which depends on the
batch (a warning says so). Greedy requests draw nothing. ``do_sample`` at a temperature of 0 (lmms-eval's
``--gen_kwargs do_sample=true`` over a task's ``temperature: 0``), which transformers refuses, is refused before any
document is read, as is beam search with an in-LLM method (``_check_requests``).
"""

from __future__ import annotations

import json
import logging

MODEL_ID = "promprune"


def MANIFEST():  # noqa: N802 - the entry point's name (pyproject.toml), kept from when it was the manifest itself
    """This plugin's ``ModelManifest``, built when lmms-eval loads its entry points. A callable, defined before this
    module imports anything of lmms-eval, since importing ``lmms_eval.models`` (where ``ModelManifest`` lives) loads
    every entry point's manifest: a manifest built at import time was looked up in this half-imported module
    ("has no attribute 'MANIFEST'") and lmms-eval dropped promprune from its registry."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path="promprune.eval.lmms_plugin.PromPruneLMM")


import torch  # noqa: E402 - after MANIFEST (see there)
from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.api.model import lmms  # noqa: E402

from promprune.eval.generation import (  # noqa: E402
    Item, decode_image, generate_items, generate_kwargs, unreadable_generation)
from promprune.eval.scoring import FAILED_ANSWER  # noqa: E402
from promprune.models.images import strict_decoding  # noqa: E402
from promprune.eval.requests import document_visual, image_key, read_clip  # noqa: E402
from promprune.eval.tasks import frames_are_clips  # noqa: E402
from promprune.dtypes import AUTO, parse_dtype  # noqa: E402
from promprune.selection.registry import UNPRUNED_NAMES as _UNPRUNED  # noqa: E402 - no method registers one of them

log = logging.getLogger(__name__)


def _dtype(value):
    """None (the loader's default, i.e. the checkpoint's dtype) for auto."""
    try:
        dtype = parse_dtype(value, allow_auto=True)
    except ValueError as exc:
        raise ValueError(f"model_args dtype: {exc}") from None
    return None if dtype == AUTO else dtype


def _method(value):
    return None if value is None or str(value).lower() in _UNPRUNED else str(value)


def _budget(value):
    if value is None or str(value).lower() in _UNPRUNED:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number.is_integer() or number < 1:
        raise ValueError(f"model_args budget={value!r} must be a positive integer")
    return int(number)


def _check_capacity(pretrained: str, budget: int | None, options: dict, clips: bool = False,
                    method: str | None = None) -> None:
    """A budget at or above the visual tokens the model gives one image prunes nothing, and the run would be reported
    as the method's: refused as the pipeline's entry points refuse it (from the model's config, before its weights
    load; a model not on this machine is left to its loading). An in-LLM ``method`` counts the prompt's image
    placeholders, newline tokens included (``adapters.visual_token_ceiling``). ``clips`` (model_args
    ``video_frames`` given: a video run): a clip of several frames gives more tokens than an image and such a budget
    still prunes it, so it is not refused (``PrunedVLM`` warns, ``FullBudgetWarning``)."""
    from promprune.models.adapters import model_capacity
    from promprune.models.factories import NotCachedError
    from promprune.models.options import is_in_llm

    if budget is None:
        return
    try:
        capacity = model_capacity(pretrained, options, in_llm=is_in_llm(method))
    except (NotCachedError, ValueError):
        return
    if capacity is not None and budget >= capacity and not clips:
        raise ValueError(f"model_args budget={budget} keeps all {capacity} visual tokens {pretrained} gives an image, "
                         f"so the run would be unpruned; use a budget below {capacity}")


def _flag(name: str, value) -> bool:
    """A true/false model_arg (lmms-eval's CLI gives strings; its own parser may give bools)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise ValueError(f"model_args {name}={value!r} must be true or false")
    return text in ("true", "1")


def _video_frames(value) -> int:
    """model_args ``video_frames`` (a string from lmms-eval's CLI): a positive int; None: the default."""
    from promprune.models.video import DEFAULT_FRAMES

    if value is None:
        return DEFAULT_FRAMES
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"model_args video_frames={value!r} must be a positive integer")
    return int(value)


class PromPruneLMM(lmms):
    """A ``PrunedVLM`` answering lmms-eval ``generate_until`` requests (one image, or one clip: a video file, or its
    frames in a task that gives clips so, ``tasks.frames_are_clips``; and one question per request).

    Pass ``vlm=`` (an existing PrunedVLM) to wrap a loaded model instead of loading ``pretrained``. A request whose
    image or video is unreadable, whose document gives no usable visual (each document is taken as a clip or an image
    by itself: ``requests.document_visual``), or whose generation fails gets ``scoring.FAILED_ANSWER`` (which
    every shipped task scores as wrong, as the pipeline's scoring replays a failed sample) and a warning;
    ``self.failures`` lists them as (task, doc_id, error). Generation kwargs that every request asking them would
    fail on are refused before any document is read (:meth:`_check_requests`); images and clips are decoded a batch
    at a time (:meth:`generate_until`).
    """

    is_simple = True

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lmms-eval's constructor from ``--model_args``, with ``batch_size`` there refused in one line: lmms-eval
        passes its own ``--batch_size`` (default 1) beside them, which Python would refuse as given twice."""
        from lmms_eval import utils

        if "batch_size" in utils.simple_parse_args_string(arg_string) and \
                (additional_config or {}).get("batch_size") is not None:
            raise ValueError("batch_size is lmms-eval's own option: pass --batch_size N instead of batch_size=N in "
                             "--model_args")
        return super().create_from_arg_string(arg_string, additional_config)

    def __init__(
        self,
        pretrained: str | None = None,
        method: str | None = "promprune",
        budget: int | None = None,
        dtype: str = "auto",
        device: str | None = None,
        attn_implementation: str | None = None,
        batch_size: int | str = 1,
        vlm=None,
        max_batch_size: int | None = None,  # passed by lmms-eval's CLI; unused (no automatic batch sizing)
        video_frames: int | str | None = None,  # frames sampled from each clip of a video task (default 8)
        vision_once: bool | str = False,  # each image encoded and selected once for all its questions
        prefix_cache: bool | str = False,  # each image's prompt prefix prefilled once (needs vision_once)
        **method_options,
    ) -> None:
        # the seed of sampled requests (see the module docstring): lmms-eval's --seed seeded torch just before this
        # constructor; read first, as loading a model may reseed torch (the tiny models are built seeded)
        self.sample_seed = torch.initial_seed()
        super().__init__()
        self.vision_once, self.prefix_cache = _flag("vision_once", vision_once), _flag("prefix_cache", prefix_cache)
        if method_options.get("enable_thinking") is not None:  # the CLI gives a string: the adapter takes a bool
            method_options["enable_thinking"] = _flag("enable_thinking", method_options["enable_thinking"])
        if self.prefix_cache and not self.vision_once:
            raise ValueError("model_args prefix_cache=true needs vision_once=true (the prefix continues the shared "
                             "encoding of each image)")
        if vlm is None:
            if not pretrained:
                raise ValueError("model_args needs "
                                 "pretrained=<checkpoint or tiny:llava|tiny:llava_next|tiny:qwen2_5_vl>")
            from promprune.models import PrunedVLM
            from promprune.models.attention import device_problem, in_llm_attention_problem, precision_problem

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            problem = precision_problem(_dtype(dtype), attn_implementation) or \
                in_llm_attention_problem(_method(method), attn_implementation) or device_problem(device)
            if problem is not None:  # before anything loads (the built model is checked again by PrunedVLM)
                raise ValueError(f"model_args: {problem}")
            _check_capacity(pretrained, _budget(budget), method_options, clips=video_frames is not None,
                            method=_method(method))
            vlm = PrunedVLM.from_pretrained(
                pretrained, method=_method(method), budget=_budget(budget), dtype=_dtype(dtype), device_map=device,
                attn_implementation=attn_implementation, **method_options,
            )
        elif pretrained or method_options:
            raise ValueError("pass either vlm= or pretrained= and method options, not both")
        self.vlm = vlm
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self.video_frames = _video_frames(video_frames)
        self.failures: list[tuple[str, int, str]] = []

    def _item(self, request: Instance, pixels: bool = True, key: str | None = None) -> Item:
        """The request as an :class:`Item`: its document read and its visual decoded (a failed item where that
        fails). ``pixels`` false: the stand-in :func:`generate_items` plans with (``load``), which keeps no pixels:
        its kind (a clip's ``video`` is True), its error where the document gives no usable visual and, with
        ``vision_once``, its image's key (decoded and hashed, then dropped; an image that cannot be decoded fails
        here). ``key``: the stand-in's, not hashed again."""
        context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
        name = f"{task} doc {doc_id}"
        # the request's identity, which its sampling seed is drawn from (with its repeat: generation.sample_seeds)
        identity = json.dumps([task, split, doc_id, request.idx], default=str)
        try:
            with strict_decoding():  # a cut-off image fails (lmms-eval turns PIL's LOAD_TRUNCATED_IMAGES on)
                doc = self.task_dict[task][split][doc_id]
            # clip or image: this doc's visual (a list of frames is a clip in a task that gives clips as frames)
            visual, video, error = document_visual(doc_to_visual, doc, name, frames_are_clips(task))
            if error:
                return Item(context, None, dict(gen_kwargs), error=error, id=identity)
            if video:  # frames sampled from the file, or picked from the task's (PrunedVLM.generate_video)
                return Item(context, None, dict(gen_kwargs), id=identity,
                            video=read_clip(visual, name, self.video_frames) if pixels else True)
            if not pixels and not self.vision_once:  # an image, decoded when its batch is formed
                return Item(context, None, dict(gen_kwargs), id=identity)
            image = decode_image(visual, name)
            if self.vision_once and key is None:
                key = image_key(image)
            return Item(context, image if pixels else None, dict(gen_kwargs), key=key, id=identity)
        except Exception as exc:  # noqa: BLE001 - an unusable doc becomes one failed (wrong) answer
            return Item(context, None, dict(gen_kwargs), error=f"{type(exc).__name__}: {exc}", id=identity)

    def _generation_problem(self, gen_kwargs: dict) -> str | None:
        """Why every request with these generation kwargs (a task's ``generation_kwargs`` with ``--gen_kwargs`` over
        them) would fail, naming the kwargs and the fix, or None: kwargs ``generate_kwargs`` cannot read
        (``generation.unreadable_generation``, which the pipeline's preflight refuses too), ``do_sample`` with a
        temperature of 0 or below (transformers refuses the pair; the pipeline's preflight refuses it too,
        ``generation.sampling_problem``), or what ``PrunedVLM`` refuses on every call
        (``vlm.check_generation_kwargs``: beam search with an in-LLM method). Sampled beam search with another method is
        answered (see the module docstring), not refused."""
        from promprune.models.vlm import check_generation_kwargs as refused

        unreadable = unreadable_generation(gen_kwargs)  # the pipeline's preflight refuses them by the same rule
        if unreadable:
            fields = "; ".join(f"{key} {gen_kwargs.get(key)!r}: {error}" for key, error in unreadable.items())
            return f"generation kwargs it cannot read ({fields}): give numbers where numbers go"
        kwargs, _ = generate_kwargs(gen_kwargs)
        temperature = kwargs.get("temperature")
        if kwargs["do_sample"] and temperature is not None and temperature <= 0:
            return (f"do_sample={gen_kwargs['do_sample']!r} with temperature={gen_kwargs['temperature']!r}: "
                    "transformers samples only at a temperature above 0 and refuses the pair (temperature 0 is "
                    "lmms-eval's greedy setting: its own models decode greedily there whatever do_sample says). To "
                    "sample, give a temperature above 0 with it (--gen_kwargs do_sample=true,temperature=0.7); for "
                    "greedy answers, leave do_sample out")
        try:
            refused(getattr(self.vlm, "method", None), kwargs)
        except ValueError as exc:
            if int(kwargs.get("num_beams", 1)) == 1:
                return f"generation kwargs the model refuses: {exc}"
            return (f"num_beams={gen_kwargs['num_beams']!r}: {exc}. Pass --gen_kwargs num_beams=1 (lmms-eval lays "
                    "it over the task's generation_kwargs), or run a method that prunes before the language model")
        return None

    def _check_requests(self, requests: list[Instance]) -> None:
        """Refuse, before any document is read, generation kwargs every request asking them would fail on
        (:meth:`_generation_problem`), checked once per distinct kwargs: one ValueError naming the tasks, the
        kwargs and the fix, instead of every such request answered as a failed sample."""
        distinct: dict[str, tuple[dict, list[str]]] = {}
        for request in requests:
            gen_kwargs, task = request.args[1], request.args[4]
            tasks = distinct.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), (gen_kwargs, []))[1]
            if task not in tasks:
                tasks.append(task)
        problems = []
        for gen_kwargs, tasks in distinct.values():
            problem = self._generation_problem(gen_kwargs)
            if problem:
                which = f"task {tasks[0]}" if len(tasks) == 1 else f"tasks {', '.join(tasks)}"
                problems.append(f"lmms-eval asks {which} for {problem}. Every request asking it would fail, so none "
                                f"is answered (the generation kwargs, the task's generation_kwargs with --gen_kwargs "
                                f"over them: {gen_kwargs})")
        if problems:
            raise ValueError(" ".join(f"{p}." for p in problems))

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Answers to ``requests`` (lmms-eval hands a model every request of its run at once), in their order. The
        generation kwargs are checked first (:meth:`_check_requests`); then each request's document is read once
        to plan the batches (its kind, its error and, with ``vision_once``, its image's key; the pixels dropped) and
        again as its batch is formed (``generate_items``' ``load``), so memory holds ``--batch_size`` decoded images
        or clips at a time, not the run's."""
        self._check_requests(requests)
        plans = [self._item(r, pixels=False) for r in requests]
        results = generate_items(self.vlm, plans, batch_size=self.batch_size, vision_once=self.vision_once,
                                 prefix_cache=self.prefix_cache, seed=self.sample_seed,
                                 load=lambda i: self._item(requests[i], key=plans[i].key))
        for request, result in zip(requests, results):
            if result.failed:
                self.failures.append((request.task_name, request.doc_id, result.error))
                log.warning("%s doc %s failed: %s", request.task_name, request.doc_id, result.error)
        # a failed request's answer: scoring's FAILED_ANSWER, which every shipped task scores wrong (an empty answer
        # would drop out of MVBench's accuracy, which counts only answers other than "")
        return [FAILED_ANSWER if result.failed else result.prediction for result in results]

    def loglikelihood(self, requests):
        raise NotImplementedError("promprune answers generate_until tasks only (no loglikelihood scoring)")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("promprune answers single-round generate_until tasks only")
