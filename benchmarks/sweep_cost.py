"""The compute of a whole sweep spec at full size: ours (vision once, prefix once) against one lmms-eval run per
configuration.

    python benchmarks/sweep_cost.py --spec sweeps/table1_llava15.yaml

Every configuration of the spec (its trials and the unpruned baseline) answers every benchmark of the spec at its
published size (:data:`BENCHMARKS`: questions and distinct images of the split lmms-eval scores). FLOPs are
``promprune.efficiency``'s, for the spec's model at its published size (``promprune.models.shapes``): the vision
tower and projector per encoded image, the prefill (Table 6's convention), the decode of the answer's tokens and the
LM head's rows. Two ways to spend them:

- one lmms-eval run per configuration: every question encodes its image, prefills its whole prompt, decodes;
- ours (``PrunedVLM.shares_vision`` / ``shares_prefix``): where the kept tokens do not depend on the question
  (unpruned, every pre-LLM method but CDPruner), each distinct image is encoded once and its prompt prefix (the
  template's head and the visual tokens) prefilled once, each question prefilling its suffix over that prefix and
  decoding; the in-LLM methods (FastV, SparseVLM, DART, PyramidDrop) prune inside the LLM per question, so each image
  is encoded once and every prompt prefilled whole; CDPruner selects per question and runs as lmms-eval does. The
  spec's ``generation.vision_once`` / ``prefix_cache`` are honoured (Table 6 turns both off: both columns are equal).

In-LLM methods run their layers on the visual tokens each layer keeps, by the schedule their hooks use at the model's
depth (``promprune.models.llm_hooks.schedule``: FastV all before its layer K, ``budget`` after; SparseVLM its released
or geometric schedule at its three layers; DART and PyramidDrop theirs; SparseVLM's few recycled tokens are not
counted), the same in both columns. Prompt and answer lengths are per-benchmark estimates under LLaVA-1.5's
tokenizer (:data:`BENCHMARKS`; the answers: what LLaVA-1.5 answers, end of sequence included); they move both
columns alike. The token selection itself (well under 1% of a sample's FLOPs) is not counted. The last line:

    <spec> at full size: A PFLOP (one lmms-eval run per configuration: B PFLOP), B/A = R
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import Flags  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    """A benchmark at its published size: questions, distinct images, prompt tokens (the question with lmms-eval's
    pre/post prompt, LLaMA tokenizer), answer tokens generated (end of sequence included), and where the sizes come
    from."""

    questions: int
    images: int
    prompt_tokens: int
    answer_tokens: int
    source: str


BENCHMARKS = {
    "mme": Benchmark(2374, 1187, 30, 2, "MME (Fu et al. 2023): 2,374 yes/no questions, a pair per image"),
    "pope": Benchmark(9000, 500, 21, 2, "POPE (Li et al. 2023): 3 x 3,000 questions over 500 COCO val2014 images"),
    "mmbench_en_dev_static": Benchmark(4329, 1164, 90, 2, "MMBench dev (en): 4,329 rows, the circular variants of "
                                                         "1,164 questions, one image each"),
    "textvqa_val": Benchmark(5000, 3166, 22, 4, "TextVQA val: 5,000 questions over 3,166 images"),
    "scienceqa_img": Benchmark(2017, 2017, 110, 2, "ScienceQA test, questions with an image: 2,017"),
    "gqa": Benchmark(12578, 398, 24, 3, "GQA testdev-balanced: 12,578 questions over 398 images"),
    "vqav2_val": Benchmark(214354, 40504, 20, 3, "VQAv2 val: 214,354 questions over 40,504 COCO val2014 images"),
    "vizwiz_vqa_val": Benchmark(4319, 4319, 42, 4, "VizWiz-VQA val: 4,319 questions, one per image"),
    "mmvet": Benchmark(218, 200, 25, 120, "MM-Vet: 218 questions over 200 images; answers of a few sentences"),
}
# LLaVA-1.5's template around the prompt: "USER: <image>\n{prompt} ASSISTANT:" (the prefix's text is the BOS and
# "USER:", the suffix's the newline and "ASSISTANT:")
HEAD_TOKENS, TAIL_TOKENS = 4, 6
# checkpoints whose published sizes ship as promprune.models.shapes, and their visual tokens per image
SHAPES = {"llava-hf/llava-1.5-7b-hf": "llava_1_5_7b"}


@dataclass
class Cost:
    ours: float = 0.0
    lmms: float = 0.0


def model_config(pretrained: str):
    from promprune.models.shapes import shape_vlm

    if pretrained not in SHAPES:
        raise SystemExit(f"sweep_cost models {list(SHAPES)} (LLaVA-1.5: one view of 576 tokens per image); the spec's "
                         f"model is {pretrained!r}")
    return shape_vlm(SHAPES[pretrained], device="meta")[0].config


def layer_tokens(method: str | None, budget: int | None, options: dict, text_config, full: int) -> list[int]:
    """Visual tokens each decoder layer of the LLM (``text_config``) runs on: ``full`` unpruned, ``budget`` for a
    pre-LLM method, an in-LLM one's schedule (``llm_hooks.schedule``: the layers and kept counts its hooks use, the
    depth-scaled defaults resolved, hybrid layer types honoured): ``full`` before its first pruning layer, each stage's
    count from its layer on."""
    import promprune
    from promprune.models import llm_hooks

    depth = int(text_config.num_hidden_layers)
    if method is None:
        return [full] * depth
    if promprune.method_spec(method).stage == promprune.PRE_LLM:
        return [min(budget, full)] * depth
    _, at, plan, _ = llm_hooks.schedule(method, text_config, budget, options)
    counts = plan(full)
    tokens = []
    for layer in range(depth):
        passed = [c for a, c in zip(at, counts) if a <= layer]
        tokens.append(passed[-1] if passed else full)
    return tokens


class LayerFlops:
    """`efficiency.layer_prefill_flops` of one LLM, remembered per (layer shape, new tokens, cached tokens): a spec
    asks it ~350,000 times (Table 1: 19 configurations x 9 benchmarks x 32 layers x each answer token), and each
    call reads the config's every layer shape; the distinct answers number a few thousand. Layers of the same shape
    share their answers."""

    def __init__(self, config):
        from promprune.efficiency import layer_shapes

        self.config = config
        shapes = layer_shapes(config)
        self.same_as = [shapes.index(shape) for shape in shapes]  # each layer -> the first of its shape
        self.known: dict[tuple[int, int, int], float] = {}

    def __call__(self, n_tokens: int, past_tokens: int = 0, layer: int = 0) -> float:
        from promprune.efficiency import layer_prefill_flops

        key = (self.same_as[layer], n_tokens, past_tokens)
        if key not in self.known:
            self.known[key] = layer_prefill_flops(self.config, n_tokens, past_tokens, layer=layer)
        return self.known[key]


def question_flops(flops: LayerFlops, tokens: list[int], bench: Benchmark, past: list[int] | None = None) -> float:
    """One question's LLM FLOPs: the prefill of its prompt (per layer, on that layer's visual tokens; with ``past``
    cached per layer only the suffix), the decode of its answer and the LM head."""
    from promprune.efficiency import lm_head_flops

    text = HEAD_TOKENS + bench.prompt_tokens + TAIL_TOKENS
    total = 0.0
    for layer, visual in enumerate(tokens):
        prompt = visual + text
        if past is None:
            total += flops(prompt, layer=layer)
        else:
            total += flops(prompt - past[layer], past[layer], layer=layer)
        total += sum(flops(1, prompt + t, layer=layer) for t in range(bench.answer_tokens - 1))
    return total + lm_head_flops(flops.config, bench.answer_tokens)


def configuration_cost(config, flops: LayerFlops, trial, bench: Benchmark, vision_once: bool,
                       prefix_cache: bool) -> Cost:
    """FLOPs of one configuration on one benchmark, both ways (``flops``: the LLM's, `LayerFlops`)."""
    import promprune
    from promprune.efficiency import vision_flops

    full = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    tokens = layer_tokens(trial.method, trial.budget, trial.options, config.text_config, full)
    vision = vision_flops(config)
    lmms = bench.questions * (vision + question_flops(flops, tokens, bench))
    spec = None if trial.method is None else promprune.method_spec(trial.method)
    shares_vision = spec is None or spec.stage == promprune.IN_LLM or not spec.question_dependent  # PrunedVLM's rules
    shares_prefix = spec is None or not spec.question_dependent
    if not (shares_vision and vision_once):
        return Cost(ours=lmms, lmms=lmms)
    if not (shares_prefix and prefix_cache):
        return Cost(ours=bench.images * vision + bench.questions * question_flops(flops, tokens, bench), lmms=lmms)
    prefix = [visual + HEAD_TOKENS for visual in tokens]
    prefill = sum(flops(p, layer=layer) for layer, p in enumerate(prefix))
    ours = bench.images * (vision + prefill) + bench.questions * question_flops(flops, tokens, bench, prefix)
    return Cost(ours=ours, lmms=lmms)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="a sweep spec, e.g. sweeps/table1_llava15.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override, as sweep.py's")
    args = p.parse_args(argv)
    from pipelines import spec as specs

    try:
        spec = specs.load(args.spec, args.set)
    except specs.SpecError as exc:  # as the other spec readers: the spec's paragraph, exit 2, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    flags = Flags(__file__)
    if spec.model.pretrained not in SHAPES:
        flags.add(f"--spec {args.spec}", f"its model is {spec.model.pretrained!r}, and sweep_cost models "
                  f"{', '.join(SHAPES)} (LLaVA-1.5: one view of 576 tokens per image); give a spec of one of them")
    missing = [t for t in spec.tasks if t not in BENCHMARKS]
    if missing:
        flags.add(f"--spec {args.spec}", f"its tasks {', '.join(missing)} have no published size here; sweep_cost "
                  f"knows {', '.join(sorted(BENCHMARKS))}; give a spec of those tasks, or --set tasks=[...] to them")
    flags.refuse()
    config = model_config(spec.model.pretrained)
    flops = LayerFlops(config.text_config.to_dict())  # a dict: its reads are cheap
    trials = specs.expand(spec)
    vision_once = spec.generation.get("vision_once", True)
    prefix_cache = spec.generation.get("prefix_cache", True)
    print(f"# {spec.name}: {len(trials)} configurations x {len(spec.tasks)} benchmarks at full size, "
          f"{spec.model.pretrained} (vision_once {vision_once}, prefix_cache {prefix_cache})\n")
    print("| benchmark | questions | images | per image | ours PFLOP | lmms-eval PFLOP | ratio | sizes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    total = Cost()
    for task in spec.tasks:
        bench = BENCHMARKS[task]
        cost = Cost()
        for trial in trials:
            if trial.tasks is None or task in trial.tasks:
                one = configuration_cost(config, flops, trial, bench, vision_once, prefix_cache)
                cost.ours += one.ours
                cost.lmms += one.lmms
        total.ours += cost.ours
        total.lmms += cost.lmms
        print(f"| {task} | {bench.questions:,} | {bench.images:,} | {bench.questions / bench.images:.1f} | "
              f"{cost.ours / 1e15:,.1f} | {cost.lmms / 1e15:,.1f} | {cost.lmms / cost.ours:.2f} | {bench.source} |")
    print("\n| configuration | ours PFLOP | lmms-eval PFLOP | ratio |")
    print("|---|---:|---:|---:|")
    for trial in trials:
        costs = [configuration_cost(config, flops, trial, BENCHMARKS[t], vision_once, prefix_cache) for t in spec.tasks
                 if trial.tasks is None or t in trial.tasks]
        ours, lmms = sum(c.ours for c in costs), sum(c.lmms for c in costs)
        name = "unpruned" if trial.method is None else f"{trial.method} {trial.budget}"
        print(f"| {name} | {ours / 1e15:,.1f} | {lmms / 1e15:,.1f} | {lmms / ours:.2f} |")
    print(f"\n{spec.name} at full size: {total.ours / 1e15:,.0f} PFLOP (one lmms-eval run per configuration: "
          f"{total.lmms / 1e15:,.0f} PFLOP), B/A = {total.lmms / total.ours:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
