"""Model factories: names like ``tiny:llava`` that build a VLM in code instead of loading a checkpoint.

``PrunedVLM.from_pretrained("<prefix>:<name>")`` looks ``prefix`` up here; anything else loads the ordinary way
(``from_pretrained`` of the checkpoint). A factory is ``fn(name, *, dtype, device_map, attn_implementation) ->
(model, processor, adapter_defaults)``; it may carry ``fn.config(name)``, the model's config without building it
(validation uses it: token counts, an unknown name). Factories are found through the
``promprune.model_factories`` entry-point group (this package declares ``tiny``, ``tiny-easyvqa``, ``testbed`` and
``shape`` in ``pyproject.toml``, so the adapters never import the modules that build or train them) and through
:func:`register_model_factory` at run time.
"""
from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

import torch

from promprune.dtypes import parse_dtype
from promprune.suggest import did_you_mean

GROUP = "promprune.model_factories"
Factory = Callable[..., tuple]

# This package's own factories, by module path (imported on first use, so the adapters never import the modules
# that build or train models). Also declared as entry points; listed here so a source checkout on PYTHONPATH,
# without `pip install`, resolves them too. Other packages add theirs through the entry-point group.
BUILTIN = {"tiny": "promprune.models.tiny:load", "tiny-easyvqa": "promprune.training.easyvqa:load",
           "shape": "promprune.models.shapes:load", "testbed": "promprune.testbed.zoo:load"}

_RUNTIME: dict[str, Factory] = {}


def register_model_factory(prefix: str, factory: Factory) -> None:
    """Make ``"<prefix>:<name>"`` build models with ``factory`` in this process (a duplicate prefix is an error)."""
    if prefix in _RUNTIME or prefix in _declared():
        raise ValueError(f"model factory {prefix!r} is already registered")
    _RUNTIME[prefix] = factory


def _declared() -> dict:
    """prefix -> a loader: this package's own, then other packages' entry points."""
    found = {ep.name: ep.load for ep in entry_points(group=GROUP)}
    found.update({name: (lambda target=target: _import(target)) for name, target in BUILTIN.items()})
    return found


def _import(target: str):
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def model_factories() -> list[str]:
    """Every registered prefix."""
    return sorted(set(_declared()) | set(_RUNTIME))


def find_model_factory(name_or_path: str) -> tuple[Factory, str] | None:
    """``(factory, name)`` for ``"<prefix>:<name>"`` with a registered prefix; None for checkpoints and paths."""
    prefix, sep, name = str(name_or_path).partition(":")
    if not sep:
        return None
    if prefix in _RUNTIME:
        return _RUNTIME[prefix], name
    declared = _declared()
    if prefix in declared:
        return declared[prefix](), name
    if "/" not in prefix and "\\" not in prefix:  # looks like a factory name, not a path or URL
        raise ValueError(f"unknown model factory {prefix!r} in {name_or_path!r}"
                         f"{did_you_mean(prefix, model_factories())}"
                         f"; registered: {', '.join(model_factories())} (or give a checkpoint name or path)")
    return None


def place(model, *, dtype=None, device_map=None, attn_implementation=None, max_memory=None):
    """Cast, move and configure a freshly built model as ``from_pretrained`` would (``"auto"`` keeps its dtype;
    ``device_map="auto"`` means CUDA when available; "balanced" / "balanced_low_0" / "sequential" or a mapping spread
    it over the GPUs within ``max_memory``, :func:`promprune.models.placement.spread`)."""
    from .placement import is_multi_gpu, spread

    dtype = parse_dtype(dtype, allow_auto=True)
    if dtype not in (None, "auto"):
        model = model.to(dtype)
    if device_map == "auto":
        device_map = "cuda" if torch.cuda.is_available() else "cpu"
    if is_multi_gpu(device_map):
        model = spread(model, device_map, max_memory)
    elif device_map is not None:
        model = model.to(device_map)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model.eval()


def _looks_like_path(name: str) -> bool:
    """A local directory rather than a hub id (``org/name``)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
        os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes")


class NotCachedError(ValueError):
    """A hub model that is neither in this machine's cache nor downloadable from here (offline, or the hub does not
    answer): the machine that runs the sweep may have it."""


# name -> the config or processor loaded (or the ValueError raised) inside `loads_once`; None outside it
_LOADED: ContextVar[dict | None] = ContextVar("promprune_models_loaded", default=None)


@contextlib.contextmanager
def loads_once():
    """Within it, :func:`model_config` and :func:`model_processor` load each model once: the first call's answer (or
    ValueError, a `NotCachedError` included) is kept, by what is loaded and the model (a hub id by its name, a local
    path by its resolved directory), and every later call returns (raises) it. One spec check (the pipeline's
    preflight) reads the same config in each of its checks and the processor twice; a hub id that is not cached
    would also have probed the hub each time. Nested: the outermost one's cache. The objects are shared: a caller
    inside must not change them."""
    token = _LOADED.set({}) if _LOADED.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _LOADED.reset(token)


def _once(kind: str, name_or_path: str, load: Callable):
    """``load()``, or inside :func:`loads_once` its kept answer (or error) for ``(kind, the model)``."""
    cache = _LOADED.get()
    if cache is None:
        return load()
    name = str(name_or_path)
    key = (kind, str(Path(name).expanduser().resolve()) if _looks_like_path(name) else name)
    if key not in cache:
        try:
            cache[key] = (True, load())
        except ValueError as exc:
            cache[key] = (False, exc)
    ok, value = cache[key]
    if not ok:
        raise value
    return value


def model_config(name_or_path: str):
    """The transformers config of a model name, factory name or path, without loading weights (once inside
    :func:`loads_once`).

    ValueError with a message saying what is wrong and how to fix it: an unknown factory or name, a local path
    that does not exist or holds no ``config.json``, or whose ``config.json`` does not load (not JSON, unreadable),
    a hub id that is not in the local cache while offline (`NotCachedError`) or does not exist. None when a factory
    cannot say.
    """
    return _once("config", name_or_path, lambda: _load_config(name_or_path))


def _load_config(name_or_path: str):
    found = find_model_factory(name_or_path)
    if found is not None:
        factory, name = found
        return factory.config(name) if hasattr(factory, "config") else None
    from transformers import AutoConfig

    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "holds no config.json"
            raise ValueError(f"model {name_or_path!r}: the local path {what}; give the directory a checkpoint was "
                             "saved to (save_pretrained), a hub id such as llava-hf/llava-1.5-7b-hf, or tiny:llava")
        try:
            return AutoConfig.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - OSError (not JSON, unreadable), ValueError, ...: the cause goes in
            raise ValueError(f"model {name_or_path!r}: its {path / 'config.json'} does not load "  # the message
                             f"({_first_line(exc)}); save the checkpoint again (save_pretrained) or fix the file"
                             ) from None
    try:  # the local cache first: no network, and enough when the model was downloaded before
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except OSError:  # not cached (transformers raises OSError for a missing file): decide below
        pass
    if hub_offline():
        raise NotCachedError(f"model {name_or_path!r}: it is not in the local Hugging Face cache and HF_HUB_OFFLINE "
                             f"is set; download it once with `hf download {name_or_path}` where there "
                             "is network access, or give a local path")
    if not hub_reachable():
        raise NotCachedError(f"model {name_or_path!r}: it is not in the local Hugging Face cache and the hub "
                             f"({hub_endpoint()}) is not reachable from here; download it where there is network "
                             "access or give a local path")
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except Exception as exc:  # noqa: BLE001 - transformers raises several types; the cause goes in the message
        raise ValueError(f"model {name_or_path!r}: the hub has no such model or refused it "
                         f"({_first_line(exc)})") from None


def model_processor(name_or_path: str):
    """The processor saved with a checkpoint (a local directory or a hub id), as ``AutoProcessor`` loads it: from the
    local cache first, as :func:`model_config`. ValueError naming the checkpoint when it does not load (a directory
    saved without its processor); `NotCachedError` for a hub id whose processor is not in the cache while offline.
    Call it where :func:`model_config` has resolved the name (a factory builds its own processor). Once inside
    :func:`loads_once`."""
    return _once("processor", name_or_path, lambda: _load_processor(name_or_path))


def _load_processor(name_or_path: str):
    from transformers import AutoProcessor

    fix = ("save the processor beside the weights (processor.save_pretrained(<dir>): its processor / preprocessor "
           "config, the tokenizer's files and the chat template)")
    if _looks_like_path(name_or_path):
        try:
            return AutoProcessor.from_pretrained(Path(name_or_path).expanduser())
        except Exception as exc:  # noqa: BLE001 - transformers raises several types; the cause goes in the message
            raise ValueError(f"model {name_or_path!r}: its processor does not load ({_first_line(exc)}); {fix}"
                             ) from None
    try:
        return AutoProcessor.from_pretrained(name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not (wholly) cached: decide below
        pass
    if hub_offline() or not hub_reachable():
        raise NotCachedError(f"model {name_or_path!r}: its processor is not in the local Hugging Face cache and the "
                             f"hub cannot be reached from here (HF_HUB_OFFLINE, or {hub_endpoint()} does not answer); "
                             f"download it once with `hf download {name_or_path}` where there is network access")
    try:
        return AutoProcessor.from_pretrained(name_or_path)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"model {name_or_path!r}: its processor does not load ({_first_line(exc)}); a checkpoint "
                         "without processor files cannot be run: load one that ships them") from None


def _first_line(exc: BaseException) -> str:
    """``Type: the first line of the message``, cut to whole words within 200 characters."""
    first = (str(exc).splitlines() or [""])[0]
    first = first if len(first) <= 200 else first[:200].rsplit(" ", 1)[0] + " ..."
    return f"{type(exc).__name__}: {first}"


def parameter_count(name_or_path: str) -> int | None:
    """The model's parameters, counted on the meta device from its config (no weights read, about a second for a 7B);
    None when its config cannot be had or no image-text-to-text class builds it. Raises ValueError as `model_config`
    does (an unknown or unreachable model)."""
    config = model_config(name_or_path)
    if config is None:
        return None
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError, TypeError):  # a config no auto class maps: the size is not known here
        return None
    return sum(p.numel() for p in model.parameters())


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """A TCP connection to the hub within a few seconds (transformers itself retries for half a minute)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(hub_endpoint())
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s):
            return True
    except OSError:
        return False
