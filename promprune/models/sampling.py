"""Sampling in which each batch row draws from its own random stream: a row's sampled answer depends on its seed,
never on the rows beside it.

transformers' ``generate(do_sample=True)`` draws every row's next token with one ``torch.multinomial`` over the
batch, from the process's RNG: a row's draws depend on which rows share its batch, in which order, and on what the
process drew before. :func:`per_row_sampling` turns such a call into a greedy one (``do_sample=False``) whose logits
processors end with the sampling warpers transformers would have added (temperature, top-k, top-p, min-p, typical,
epsilon, eta, top-h: built by transformers itself, ``GenerationMixin._get_logits_processor``, from the same merged
generation config and in its order, after every other processor as in sampling) and :class:`GumbelNoise`, which adds
to row ``i``'s scores at step ``t`` Gumbel(0, 1) noise drawn from a ``torch.Generator`` seeded from
``(seeds[i], t)`` alone. ``argmax(scores + G)``, G i.i.d. Gumbel, is an exact draw from ``softmax(scores)`` (the
Gumbel-max trick), so each token is drawn from the distribution ``generate(do_sample=True)`` samples, from noise
that only the row's own seed and the step decide: the same row gives the same answer in any batch (on the same
hardware and software). A finished row keeps drawing its own noise (transformers pads its tokens); no row ever
draws from another's stream, and the process's RNG is never touched.
"""
from __future__ import annotations

import copy
import hashlib

import torch
from transformers import GenerationConfig, LogitsProcessor

# the generation config fields of transformers' sampling warpers ("processors previously known as LogitsWarpers"),
# which generate adds only with do_sample
WARPER_FIELDS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
_WARPERS = {"TemperatureLogitsWarper", "TopHLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
            "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper"}


def step_seed(seed: int, step: int) -> int:
    """The seed of a row's noise at one step: a hash of ``(seed, step)`` below 2**63 (what torch takes)."""
    digest = hashlib.blake2b(f"{int(seed)}/{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def gumbel(n: int, seeds: list[int], device) -> torch.Tensor:
    """``[len(seeds), n]`` float32 i.i.d. Gumbel(0, 1) draws on ``device``, row ``i``'s from a generator seeded with
    ``seeds[i]`` alone (one generator, reseeded per row: the draws of a fresh one), transformed in one pass."""
    generator = torch.Generator(device=device)
    uniform = torch.empty(len(seeds), n, device=device, dtype=torch.float32)
    for row, seed in zip(uniform, seeds):
        torch.rand(n, generator=generator.manual_seed(seed), out=row)
    return -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))


def generation_value(generation_kwargs: dict, name: str):
    """A ``generate`` setting as given: the kwarg, else the ``generation_config`` kwarg's (None: not given)."""
    if name in generation_kwargs:
        return generation_kwargs[name]
    return getattr(generation_kwargs.get("generation_config"), name, None)


def merged_config(model, generation_kwargs: dict) -> GenerationConfig:
    """transformers' own merge of ``generation_kwargs`` (a ``generation_config`` among them) over ``model``'s
    generation config and its defaults: what ``model.generate(**generation_kwargs)`` decodes by."""
    given = dict(generation_kwargs)
    merged, _ = model._prepare_generation_config(given.pop("generation_config", None), **given)
    return merged


class GumbelNoise(LogitsProcessor):
    """Adds to row ``i``'s scores Gumbel noise from ``seeds[i]`` and the step (0 at the first generated token): under
    greedy decoding the argmax is a draw from ``softmax(scores)``, the row's own (see the module docstring)."""

    def __init__(self, seeds: list[int]):
        self.seeds = [int(s) for s in seeds]
        self.start: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"per-row sampling has {len(self.seeds)} seeds for a batch of {scores.shape[0]} rows")
        if self.start is None:
            self.start = input_ids.shape[1]
        step = input_ids.shape[1] - self.start
        noise = gumbel(scores.shape[1], [step_seed(s, step) for s in self.seeds], scores.device)
        return scores + noise.to(scores.dtype)


def warpers(model, generation_kwargs: dict) -> list[LogitsProcessor]:
    """The sampling warpers ``model.generate(do_sample=True, **generation_kwargs)`` applies, in its order: built by
    transformers from its own merge of ``generation_kwargs`` (and a ``generation_config`` among them) over the
    model's generation config and its defaults (e.g. top-k 50 where nothing sets top_k)."""
    merged = merged_config(model, generation_kwargs)
    only = GenerationConfig(do_sample=True, num_beams=1, **{f: getattr(merged, f, None) for f in WARPER_FIELDS})
    built = list(model._get_logits_processor(generation_config=only, device=str(model.device)))
    other = [type(p).__name__ for p in built if type(p).__name__ not in _WARPERS]
    if other:  # a transformers whose warper-only config builds more than warpers: never sample from a wrong law
        raise RuntimeError(f"per-row sampling expected only sampling warpers from transformers, got {other}")
    return built


def per_row_sampling(model, generation_kwargs: dict, seeds: list[int]) -> tuple[dict, list[LogitsProcessor]]:
    """``(kwargs, processors)``: ``generate`` kwargs that decode greedily, the sampling ones removed (from the kwargs
    and from a copy of a ``generation_config`` kwarg, which ``generation_kwargs`` may sample by), and the logits
    processors to append after the caller's (:func:`warpers`, then :class:`GumbelNoise` of ``seeds``, one per row),
    so that the call samples as ``generation_kwargs`` (with ``do_sample=True``) ask, each row from its own seed.
    One beam only: sampled beam search draws among beams, not per row (a ValueError)."""
    num_beams = generation_value(generation_kwargs, "num_beams")
    if int(num_beams or 1) != 1:
        raise ValueError(f"seeded sampling draws each answer from its own seed, one sequence per prompt: num_beams "
                         f"must be 1 with do_sample, got {num_beams!r}")
    kwargs = {k: v for k, v in generation_kwargs.items() if k not in WARPER_FIELDS}
    config = kwargs.get("generation_config")
    if config is None:
        processors = [*warpers(model, {**generation_kwargs, "do_sample": True}), GumbelNoise(seeds)]
        kwargs["do_sample"] = False
        return kwargs, processors
    # do_sample set where the caller's is: in (copies of) the generation_config, a kwarg do_sample dropped (a kwarg
    # beside a generation_config makes transformers warn)
    sampled = copy.deepcopy(config)
    sampled.do_sample = True
    given = {k: v for k, v in generation_kwargs.items() if k != "do_sample"}
    processors = [*warpers(model, {**given, "generation_config": sampled}), GumbelNoise(seeds)]
    greedy = kwargs["generation_config"] = copy.deepcopy(config)
    greedy.do_sample = False
    for name in WARPER_FIELDS:
        if hasattr(greedy, name):
            setattr(greedy, name, None)  # unset: transformers' merge fills it, as where a kwarg was removed
    kwargs.pop("do_sample", None)
    return kwargs, processors
