"""The architecture registry: every VLM family the adapters support, each declared whole in its own module.

A family is one module of :mod:`promprune.models.architectures` whose adapter class carries :func:`register_family`:

.. code-block:: python

    @register_family("llava", model_class="LlavaForConditionalGeneration", default_mu=0.42, tiny=tiny_llava,
                     shape=shape_llava, capacity=llava_capacity)
    class LlavaAdapter(Adapter): ...

The decorator records a :class:`Family`: the name (the checkpoint's ``config.model_type``, also ``tiny:<name>``), the
transformers class that loads it, the adapter (how its images become candidate tokens, and, where it defines
``encode_video``, its clips), the default prominence threshold ``mu``, the tiny and shape factories, the most visual
tokens an image gives (and, where the prompt holds more, the most placeholders), the fewest every image gives, the
most views (crops, tiles) an image gives, and whether the LLM keeps 3D M-RoPE positions (the in-LLM methods then never
renumber). Nothing outside a family's module names the architecture (``tests/models/test_families.py`` scans the
source): ``PrunedVLM``, ``tiny:`` / ``shape:``, video, the in-LLM hooks and the capacity checks of the pipeline's
preflight all ask the registry.

The family modules are found by listing the package (``pkgutil``): the module ``architectures/<name>.py`` registers the
family ``<name>`` (every shipped family's module is so named), so a lookup by name (or by a config's ``model_type``)
imports that module alone (and the families it builds on), keeping a worker that loads one checkpoint from importing
every architecture's transformers classes; a name no module of its own registers is looked up in every family module
(a family registered from a module named otherwise is found, at the cost of importing them all); listing the
families imports them all. A new family is one new file. A duplicate name is a ValueError; an unknown one
says "did you mean" and lists the registered names.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from promprune.suggest import did_you_mean

PACKAGE = "promprune.models.architectures"


def one_view(config) -> int:
    """Default ``max_views``: an image is one view."""
    return 1


def no_fixed_capacity(config, options: dict) -> int | None:
    """Default ``capacity`` and ``fewest``: the token count depends on the image (no fixed most, no known floor)."""
    return None


@dataclass(frozen=True)
class Family:
    """One architecture (see the module docstring).

    - ``name``: ``config.model_type`` of its checkpoints; ``model_class``: the transformers class that loads them.
    - ``adapter``: the :class:`promprune.models.adapters.Adapter` subclass; it handles clips when it defines
      ``encode_video`` (:attr:`video`); its ``check_config(config)`` refuses a config of the family it cannot run
      (:func:`family_of` calls it). Its processor is :attr:`processor_class`, with a chat template.
    - ``default_mu``: PromPrune's prominence threshold unless given (why that value: a comment at the registration).
    - ``tiny() -> (model, processor)``: the seeded random-weight tiny model (``tiny:<name>``); ``shape(spec,
      text_layers, vision_layers) -> (model class, config, processor)``: a published size from its JSON in
      ``promprune/models/shapes`` (``shape:<checkpoint>``); either may be None.
    - ``capacity(config, adapter_options) -> int | None``: the most visual tokens one image gives the LLM (None: it
      depends on the image); ``max_views(config) -> int``: the most views one image gives.
    - ``most(config, adapter_options) -> int | None``: the most visual tokens one image gives counted as the in-LLM
      methods count them (the image placeholders in the prompt, ``image_newline`` tokens included), where that exceeds
      ``capacity`` (LLaVA-NeXT, LLaVA-OneVision: the newlines); None (the default): ``capacity`` counts them all. What
      ``vlm.larger_images_problem`` tries an in-LLM budget at.
    - ``fewest(config, adapter_options) -> int | None``: a floor on the visual tokens every image gives, counted as the
      in-LLM methods count them (the image placeholders in the prompt, ``image_newline`` tokens included), at most the
      fewest any image gives (None: none known). An in-LLM budget whose schedule fails at this count fails on every
      image, so construction refuses it (``vlm.construction_problems``); above it, a failing image is its own sample.
    - ``mrope``: the LLM numbers visual tokens by 3D M-RoPE positions that pruning keeps (in-LLM methods never
      renumber them).
    """

    name: str
    model_class: str
    adapter: type
    default_mu: float
    module: str
    tiny: Callable[[], tuple] | None = None
    shape: Callable[..., tuple] | None = None
    capacity: Callable[..., int | None] = no_fixed_capacity
    fewest: Callable[..., int | None] = no_fixed_capacity
    most: Callable[..., int | None] | None = None
    max_views: Callable[..., int] = one_view
    mrope: bool = False

    @property
    def processor_class(self) -> str | None:
        """The processor class its checkpoints ship: transformers' ``AutoProcessor`` mapping of ``name`` (None: a
        family transformers does not map); ``adapters.check_processor`` refuses a processor of another class."""
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

        return PROCESSOR_MAPPING_NAMES.get(self.name)

    @property
    def video(self) -> bool:
        """Whether its adapter answers about clips (:mod:`promprune.models.video`)."""
        return callable(getattr(self.adapter, "encode_video", None))

    def transformers_class(self):
        """The transformers class named by ``model_class``."""
        import transformers

        return getattr(transformers, self.model_class)


_FAMILIES: dict[str, Family] = {}
_LOADED = False


def register_family(name: str, *, model_class: str, default_mu: float, tiny=None, shape=None,
                    capacity=no_fixed_capacity, fewest=no_fixed_capacity, most=None, max_views=one_view,
                    mrope: bool = False):
    """Class decorator of a family's adapter: register the family ``name`` (see :class:`Family` for the fields).
    A name registered twice is a ValueError naming both modules."""

    def register(adapter: type) -> type:
        if name in _FAMILIES:
            raise ValueError(f"model family {name!r} is already registered (by {_FAMILIES[name].module}); "
                             f"{adapter.__module__} registers it again: one module per family")
        _FAMILIES[name] = Family(name=name, model_class=model_class, adapter=adapter, default_mu=float(default_mu),
                                 module=adapter.__module__, tiny=tiny, shape=shape, capacity=capacity,
                                 fewest=fewest, most=most, max_views=max_views, mrope=mrope)
        return adapter

    return register


def _module_names() -> list[str]:
    """The module names of the families package (each ``<name>.py`` registers the family ``<name>``)."""
    package = importlib.import_module(PACKAGE)
    return [info.name for info in pkgutil.iter_modules(package.__path__)]


def _load(name: str | None = None) -> None:
    """Import what registers the family ``name``: its module ``<name>.py`` when the package has one, so a lookup by
    name imports only that family's module and the ones it builds on; when that registers no family ``name`` (no such
    module, or a module named otherwise registers it), every family module once, as ``name`` None does."""
    global _LOADED
    if name is not None:
        if name not in _FAMILIES and name in _module_names():
            importlib.import_module(f"{PACKAGE}.{name}")
        if name in _FAMILIES:
            return
    if not _LOADED:
        for module in _module_names():
            importlib.import_module(f"{PACKAGE}.{module}")
        _LOADED = True


def families() -> list[str]:
    """Every registered family name, sorted."""
    _load()
    return sorted(_FAMILIES)


def family(name: str) -> Family:
    """The family registered as ``name``; ValueError with did-you-mean and the registered names otherwise."""
    _load(str(name))
    if name not in _FAMILIES:
        names = families()
        raise ValueError(f"unknown model family {name!r}{did_you_mean(name, names)}; registered: {', '.join(names)}")
    return _FAMILIES[name]


def check_builds_own(fam: Family, config, factory: str) -> None:
    """ValueError when the family's ``factory`` ("tiny" or "shape") built a config of another ``model_type``: a model is
    run by the adapter of its config's ``model_type``, so it would run another family's adapter (or none)."""
    kind = getattr(config, "model_type", None)
    if kind == fam.name:
        return
    other = find_family(config)
    runs = (f"family {other.name!r}'s adapter ({other.module})" if other is not None else
            "no registered family's adapter (PrunedVLM would refuse it)")
    raise ValueError(f"model family {fam.name!r}'s {factory} factory ({fam.module}) builds a config of model_type "
                     f"{kind!r}, so its model would run {runs}: a model is run by the adapter registered under its "
                     f"config.model_type. Build the family's own config (model_type {fam.name!r}), or register the "
                     f"family under the name {kind!r}")


def find_family(config) -> Family | None:
    """The family of a model config (by ``model_type``), None when none is registered."""
    kind = getattr(config, "model_type", None)
    if not isinstance(kind, str):
        return None
    _load(kind)
    return _FAMILIES.get(kind)


def family_of(config) -> Family:
    """The family of a model config (by ``model_type``) whose adapter runs it; ValueError with did-you-mean and the
    supported types, or the adapter's own reason (``check_config``: a LLaVA whose vision tower is not CLIP)."""
    found = find_family(config)
    if found is None:
        kind = getattr(config, "model_type", None)
        names = families()
        raise ValueError(f"unsupported model type {kind!r}{did_you_mean(kind, names)}; supported: {', '.join(names)}")
    check = getattr(found.adapter, "check_config", None)
    if check is not None:
        check(config)
    return found
