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
itself; ``batch_size`` in ``--model_args`` is refused, naming that option).

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
batch (a warning says so). Greedy requests draw nothing.
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

from promprune.eval.generation import Item, decode_image, generate_items  # noqa: E402
from promprune.eval.scoring import FAILED_ANSWER  # noqa: E402
from promprune.models.images import strict_decoding  # noqa: E402
from promprune.eval.requests import document_visual, image_key  # noqa: E402
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
    """A ``PrunedVLM`` answering lmms-eval ``generate_until`` requests (one image, or one video file, and one question
    per request).

    Pass ``vlm=`` (an existing PrunedVLM) to wrap a loaded model instead of loading ``pretrained``. A request whose
    image or video is unreadable, whose document gives no usable visual (each document is taken as a clip or an image
    by itself: ``requests.document_visual``), or whose generation fails gets ``scoring.FAILED_ANSWER`` (which
    every shipped task scores as wrong, as the pipeline's scoring replays a failed sample) and a warning;
    ``self.failures`` lists them as (task, doc_id, error).
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

    def _item(self, request: Instance) -> Item:
        from promprune.models.video import Clip, decode_video

        context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
        name = f"{task} doc {doc_id}"
        # the request's identity, which its sampling seed is drawn from (with its repeat: generation.sample_seeds)
        identity = json.dumps([task, split, doc_id, request.idx], default=str)
        try:
            with strict_decoding():  # a cut-off image fails (lmms-eval turns PIL's LOAD_TRUNCATED_IMAGES on)
                doc = self.task_dict[task][split][doc_id]
            visual, video, error = document_visual(doc_to_visual, doc, name)  # clip or image: this doc's visual
            if error:
                return Item(context, None, dict(gen_kwargs), error=error, id=identity)
            if video:  # frames sampled from the file (PrunedVLM.generate_video)
                return Item(context, None, dict(gen_kwargs), video=Clip(*decode_video(visual, self.video_frames)),
                            id=identity)
            image = decode_image(visual, name)
            return Item(context, image, dict(gen_kwargs), key=image_key(image) if self.vision_once else None,
                        id=identity)
        except Exception as exc:  # noqa: BLE001 - an unusable doc becomes one failed (wrong) answer
            return Item(context, None, dict(gen_kwargs), error=f"{type(exc).__name__}: {exc}", id=identity)

    def generate_until(self, requests: list[Instance]) -> list[str]:
        results = generate_items(self.vlm, [self._item(r) for r in requests], batch_size=self.batch_size,
                                 vision_once=self.vision_once, prefix_cache=self.prefix_cache, seed=self.sample_seed)
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
