"""Where an actor's model comes from, and how a sweep loads each checkpoint's weights only once.

Loading a 7B checkpoint (`from_pretrained`: read ~14 GB of safetensors, build the module, copy the weights in)
takes tens of seconds per actor, and a sweep starts `trials x workers` actors. Pruning never changes the weights:
every trial of a sweep uses the same model and only wraps it differently (`PrunedVLM(model, processor, method,
budget, ...)`). So the sweep loads each checkpoint once, in one Ray task, and publishes it to the object store:

- `share(source)`: a task loads the model (on CPU, in the dtype the actors will use), copies every parameter and
  buffer into numpy arrays (bfloat16 as an int16 view: numpy has no bf16) and returns `(recipe, processor,
  arrays)`, the recipe being the model class, its config and where each array goes. Ray stores the arrays in
  shared memory, once per node that needs them.
- `ModelSource.load(...)` in an actor with `shared` set: `ray.get` maps the arrays zero-copy from the node's
  object store, the model class is built on the meta device (no memory, no random init) and the arrays become
  its tensors (tied weights stay tied), the model moves to the GPU, and a `PrunedVLM` wraps it. No file is read
  and no weight is initialized. On CPU the actors of one node even share a single copy of the weights.

`benchmarks/model_loading.py` measures both paths. Without sharing (`resources.share_weights: false`) every
actor calls `PrunedVLM.from_pretrained` itself.

An actor Ray gave several GPUs (`resources.gpus_per_worker: 2`: Gemma 4 31B in bfloat16, ~62 GB, on 48 GB A40s) loads
one model across them: `gpu_placement` turns the GPUs it holds into a balanced device map with a memory limit per GPU
(`promprune.models.placement`), which `from_pretrained` (or, for published weights, `materialize`) follows.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, Field, PlainValidator, StrictStr, with_config
from pydantic_core import PydanticCustomError

from promprune.dtypes import AUTO as AUTO_DTYPE
from promprune.dtypes import CANONICAL_DTYPES, canonical_dtype

from pipelines.config import SECTION, expect, one_of, problem

DTYPES = (AUTO_DTYPE, *CANONICAL_DTYPES)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def _dtype_name(value: Any) -> str:
    """A spec's / CLI's dtype as its canonical name (`DTYPES`): every alias the library takes (fp16, bf16, half,
    double; `promprune.dtypes.canonical_dtype`, the one parser), a typo refused with a did-you-mean."""
    if not isinstance(value, str):
        raise problem(f"expected a dtype name ({', '.join(DTYPES)}), got {value!r}")
    try:
        return canonical_dtype(value, allow_auto=True)
    except ValueError as exc:
        raise problem(str(exc)) from None


Dtype = Annotated[str, PlainValidator(_dtype_name)]
AttnImplementation = one_of(*ATTN_IMPLEMENTATIONS)


def prepare_model(name: str) -> None:
    """First-use work of a factory-built model (e.g. training tiny-easyvqa:llava), in the driver with its progress
    bar on the terminal, before Ray starts (in a Ray worker it ran niced, its bar relayed a line now and then);
    nothing for checkpoints. `pipelines/sweep.py` and `pipelines/evaluate.py` call it."""
    from promprune.models.factories import find_model_factory

    found = find_model_factory(name)
    if found is not None and hasattr(found[0], "prepare"):
        found[0].prepare(found[1])


def resolve_dtype(dtype: str, on_gpu: bool) -> str:
    """'auto' -> bfloat16 on GPU (the 7B checkpoints' training dtype), float32 on CPU (no fast bf16 matmul)."""
    from promprune.dtypes import AUTO, dtype_name

    if dtype == AUTO:
        return "bfloat16" if on_gpu else "float32"
    try:
        return dtype_name(dtype)
    except ValueError as exc:
        raise ValueError(f"dtype: {exc}") from None


def local_device() -> str:
    """The device this process may use: CUDA when Ray gave it a GPU that torch can see."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    import ray

    if ray.is_initialized() and not ray.get_gpu_ids():  # a Ray worker without a GPU assigned keeps off the GPU
        return "cpu"
    return "cuda"


def gpu_placement(gpu_ids: list, gpu_bytes: list[int]) -> dict | None:
    """``{"device_map", "max_memory"}`` spreading one model over the GPUs Ray assigned this process (``gpu_ids``,
    ``ray.get_gpu_ids()``), whose memory torch reports as ``gpu_bytes`` (Ray sets CUDA_VISIBLE_DEVICES to those ids, so
    torch's devices 0 .. n-1 are they); None for one GPU or none. A mismatch (torch sees other GPUs than Ray assigned)
    is a RuntimeError naming both."""
    from promprune.models.placement import gpu_split

    if len(gpu_ids) < 2:
        return None
    if len(gpu_bytes) != len(gpu_ids):
        raise RuntimeError(f"Ray assigned this actor GPUs {list(gpu_ids)} but torch sees {len(gpu_bytes)} GPU(s): "
                           "CUDA_VISIBLE_DEVICES was changed after Ray set it; leave it to Ray")
    return gpu_split(gpu_bytes)


def actor_placement() -> dict | None:
    """:func:`gpu_placement` of this process: the GPUs Ray assigned it and their memory as torch sees it."""
    import ray
    import torch

    if not (ray.is_initialized() and torch.cuda.is_available()):
        return None
    sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    return gpu_placement(ray.get_gpu_ids(), sizes)


def _not_a_spec_field(value: Any) -> Any:
    raise PydanticCustomError("extra_forbidden", "not a spec field")


@with_config(SECTION)
@dataclass
class ModelSource:
    """A checkpoint and how to load it; picklable, sent to every actor. The spec's ``model:`` section."""

    # the offline tiny LLaVA
    pretrained: Annotated[StrictStr, Field(pattern=r"\S"), expect("a checkpoint name or path")] = "tiny:llava"
    dtype: Dtype = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # saliency comes from hooks, so SDPA stays on everywhere
    attn_implementation: AttnImplementation = "sdpa"
    # adapter options (budget_mode, image_tokens, ...); checked against promprune.models by pipelines.spec
    options: Annotated[dict, expect("a mapping of adapter kwargs")] = field(default_factory=dict)
    # ObjectRef from share(): weights published once per sweep; None: from_pretrained per actor. Not a spec field.
    shared: Annotated[Any, AfterValidator(_not_a_spec_field)] = field(default=None, metadata={"spec": False})

    def load(self, *, method: str | None, budget: int | None, options: dict | None = None):
        """A PrunedVLM on this process's device (CUDA if assigned, else CPU); over all its GPUs when Ray assigned it
        several (:func:`actor_placement`)."""
        from promprune.models import PrunedVLM

        device = local_device()
        opts = {**self.options, **(options or {})}
        split = actor_placement() if device == "cuda" else None
        if self.shared is not None:
            import ray

            model, processor = materialize(ray.get(self.shared), device, split)
            return PrunedVLM(model, processor, method=method, budget=budget, **opts)
        dtype = resolve_dtype(self.dtype, device == "cuda")
        placed = split or {"device_map": device}
        return PrunedVLM.from_pretrained(self.pretrained, method=method, budget=budget, dtype=dtype,
                                         attn_implementation=self.attn_implementation, **placed, **opts)

    def with_shared(self, ref: Any) -> "ModelSource":
        return dataclasses.replace(self, shared=ref)


# ----------------------------------------------------------------------------------------------------------------
# tensors out of a module and back in


def extract(model) -> tuple[dict, list[np.ndarray]]:
    """Every parameter and buffer of `model` as numpy arrays, plus what rebuilds the module around them.

    Returns (recipe, arrays): recipe = {cls, config, generation_config, layout}, where layout lists
    `(qualified name, "param" | "buffer", array index, torch dtype name)`; a tensor reachable under several names
    (tied embeddings) is stored once and stays shared after `restore`. Buffers that are not in the state dict
    (rotary `inv_freq`) are included, so the rebuilt module holds exactly the loaded values.
    """
    arrays: list[np.ndarray] = []
    index_of: dict[int, int] = {}
    layout: list[tuple] = []
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            key = id(tensor)
            if key not in index_of:
                index_of[key] = len(arrays)
                arrays.append(_to_numpy(tensor.detach().cpu()))
            layout.append((name, kind, index_of[key], str(tensor.dtype).removeprefix("torch.")))
    recipe = {"cls": type(model), "config": model.config, "layout": layout,
              "generation_config": getattr(model, "generation_config", None)}
    return recipe, arrays


def _to_numpy(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
        return t.view(torch.int16).numpy()
    return t.numpy()


def restore(recipe: dict, arrays: list[np.ndarray]):
    """Rebuild the module on the meta device (its own __init__ runs, no memory, no weight init) and put the
    arrays in (zero-copy on CPU: object-store arrays are read-only, and inference never writes to weights)."""
    import torch

    with torch.device("meta"):
        model = recipe["cls"](recipe["config"])
    tensors: dict[int, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": intended, see docstring
        for name, kind, idx, dtype_name in recipe["layout"]:
            if idx not in tensors:
                t = torch.from_numpy(arrays[idx])
                tensors[idx] = t.view(torch.bfloat16) if dtype_name == "bfloat16" else t
            path, _, leaf = name.rpartition(".")
            module = model.get_submodule(path)
            if kind == "param":
                module._parameters[leaf] = torch.nn.Parameter(tensors[idx], requires_grad=False)
            else:
                module._buffers[leaf] = tensors[idx]
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"restore: tensors missing from the published weights: {left[:5]}")
    if recipe.get("generation_config") is not None:
        model.generation_config = recipe["generation_config"]
    return model


def materialize(published: tuple, device: str, split: dict | None = None):
    """(recipe, processor, arrays) from the object store -> (model on `device`, processor); ``split``
    (:func:`gpu_placement`): spread over this process's GPUs instead."""
    recipe, processor, arrays = published
    model = restore(recipe, arrays)
    if split is not None:
        from promprune.models.placement import spread

        model = spread(model, split["device_map"], split["max_memory"])
    elif device != "cpu":
        model = model.to(device)
    return model.eval(), processor


def load_for_sharing(source: ModelSource, on_gpu: bool) -> tuple:
    """Load the checkpoint once on CPU, in the dtype the actors will run, and strip it for the object store."""
    from promprune.models import PrunedVLM

    dtype = resolve_dtype(source.dtype, on_gpu)
    vlm = PrunedVLM.from_pretrained(source.pretrained, method=None, budget=None, dtype=dtype, device_map="cpu",
                                    attn_implementation=source.attn_implementation, **source.options)
    recipe, arrays = extract(vlm.model)
    return (recipe, vlm.processor, arrays), sum(a.nbytes for a in arrays)


def share(source: ModelSource, on_gpu: bool, in_process: bool = False):
    """Publish `source`'s weights to the object store from one Ray task; returns the source with `shared` set.

    The task's result is owned by the caller (the sweep driver) and lives in the object store of the node that
    ran the task; other nodes pull it once. If that node dies, Ray re-runs the task (lineage reconstruction).
    ``in_process``: load here and `ray.put` the result instead (a local Ray on one machine: this process has the
    libraries imported already, a task would import them again in a new process).
    """
    import ray

    if in_process:
        published, _ = load_for_sharing(dataclasses.replace(source, shared=None), on_gpu)
        return source.with_shared(ray.put(published))
    task = ray.remote(num_cpus=1, max_retries=3, num_returns=2)(load_for_sharing)
    ref, n_bytes = task.remote(dataclasses.replace(source, shared=None), on_gpu)
    ray.get(n_bytes)  # small: raises load errors here, before any trial starts; the weights stay remote
    return source.with_shared(ref)
