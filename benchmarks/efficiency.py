"""Efficiency of visual-token pruning: the paper's Table 6 (analytic) and measured latency / memory on a model.

    python benchmarks/efficiency.py                                  # tiny offline LLaVA-NeXT on this machine
    python benchmarks/efficiency.py --model llava-hf/llava-v1.6-vicuna-7b-hf --dtype float16 \
        --budgets none,640,320,160                                   # Table 6's setting, on a GPU
    python benchmarks/efficiency.py --model shape:llava_next_7b --budgets none,320 \
        --methods vispruner,divprune,promprune                       # Table 6's shape, random weights, no download
    python benchmarks/efficiency.py --model shape:qwen3_vl_8b --dtype float16 \
        --budgets none,512,256,128                                   # also shape:qwen2_5_vl_7b,
                                                                     # shape:llava_onevision_7b, shape:internvl3_8b,
                                                                     # shape:qwen3_5_4b (hybrid LLM)
    python benchmarks/efficiency.py --skip-measured --analytic-shape gemma4_31b \
        --budgets none,62,31,16                                      # Gemma 4 31B's rows, analytic (issue 46)

Part 1 prints prefill TFLOPs and KV-cache MiB of LLaVA-NeXT-7B's text model (Vicuna-7B) from
``promprune.efficiency`` next to the published Table 6 numbers; ``--analytic-shape`` adds the same rows for a shipped
shape's LLM at ``--budgets`` (Gemma 4 31B: its sliding-window layers attend to and cache at most 1024 tokens, its full
layers' own head widths; ``promprune.efficiency.layer_shapes``), 62 text tokens, bfloat16. Part 2 loads ``--model``
once, wraps it with each method and budget, and reports per arm: visual tokens the LLM received (an in-LLM method's:
after its last cut), the analytic FLOPs / KV for that model's own text config as the pipeline logs them
(``promprune.efficiency.generation_cost``: an in-LLM method's layers each on the visual tokens it ran on and cached,
every one before its cut; a hybrid LLM such as Qwen3.5 as it is: KV only for its full-attention layers, and beside it
the constant recurrent state of its linear-attention layers, which no token adds to), and the measured median vision,
selection and LLM prefill time, their sum (Table 6's "prefill"), the full generate time and peak memory (synchronized
wall clock; the CUDA allocator's high-water mark on a GPU, the process's peak RSS during the timed calls on CPU, on
Linux only). On a GPU, PromPrune is
measured once more with CUDA graphs (``accel.graphs``), and then eager and graphed calls are timed interleaved
(``--graph-pairs``, ``paired_graphs``) for its select ms. A printed table, never an assertion: timings depend on the
machine. An ``--analytic-shape`` whose visual-token count depends on the image (MiniCPM-V 4.6) has no unpruned row:
give its ``--budgets`` as counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags, comma_list  # noqa: E402
from promprune.efficiency import (  # noqa: E402
    MIB,
    generation_cost,
    kv_cache_bytes,
    peak_memory_mb,
    prefill_flops,
    recurrent_state_bytes,
    reset_peak_memory,
)
from promprune.selection import accel, certified, graphed  # noqa: E402

# Vicuna-7B (the text model of llava-v1.6-vicuna-7b), the dimensions Table 6 uses
VICUNA_7B = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32)
# derived, not stated in the paper: the one text-token count whose prefill FLOPs round to both published numbers
# (42.6 T at 2880 visual tokens: 57 to 62; 5.02 T at 320: 62 only; promprune.efficiency's convention)
TABLE6_TEXT_TOKENS = 62
TABLE6_PUBLISHED = {2880: (42.6, 1440.0), 320: (5.02, 160.0)}  # visual tokens -> (TFLOPs, KV MB)


def table6_analytic(visual_tokens=(2880, 640, 320, 160)) -> None:
    print("## Table 6, analytic (LLaVA-NeXT-7B / Vicuna-7B, fp16, 62 text tokens)\n")
    print("| visual tokens | prefill TFLOPs | published | KV cache MiB (visual) | published |")
    print("|---:|---:|---:|---:|---:|")
    for n in visual_tokens:
        tflops = prefill_flops(VICUNA_7B, n + TABLE6_TEXT_TOKENS) / 1e12
        kv = kv_cache_bytes(VICUNA_7B, n, torch.float16) / MIB
        pub_f, pub_kv = TABLE6_PUBLISHED.get(n, ("", ""))
        print(f"| {n} | {tflops:.3g} | {pub_f} | {kv:.1f} | {pub_kv} |")
    print()


def shape_analytic(name: str, budgets, text_tokens: int = TABLE6_TEXT_TOKENS) -> None:
    """Table 6's columns for the shape ``name``'s LLM: ``budgets`` visual tokens (None: the most one image gives,
    ``visual_token_capacity``) and ``text_tokens`` text tokens, bfloat16."""
    from promprune.models.adapters import visual_token_capacity
    from promprune.models.shapes import default_options, load

    config = load.config(name)
    full = visual_token_capacity(config, default_options(name))
    print(f"## Analytic: shape:{name} ({text_tokens} text tokens, bfloat16)\n")
    print("| visual tokens | prefill TFLOPs | KV cache MiB (visual) |")
    print("|---:|---:|---:|")
    for n in [full if b is None else b for b in budgets]:
        tflops = prefill_flops(config, n + text_tokens) / 1e12
        print(f"| {n} | {tflops:.3g} | {kv_cache_bytes(config, n, torch.bfloat16) / MIB:.4g} |")
    print()


def sample_images(n: int) -> list[Image.Image]:
    """Real photographs bundled with scikit-image (offline), cycled to ``n``."""
    from skimage import data

    photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    return [Image.fromarray(np.asarray(photos[i % len(photos)])).convert("RGB") for i in range(n)]


def _budget(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def check_flags(args) -> None:
    """Refuse the command line's mistakes (exit 2, `benchmarks.Flags`) before the model loads."""
    flags = Flags(__file__)
    if args.skip_measured and args.skip_analytic:
        flags.add("--skip-measured --skip-analytic", "together they leave nothing to print; drop one of them")
    if args.analytic_shape and not args.skip_analytic:
        from promprune.models.shapes import shapes

        if flags.choice("--analytic-shape", [args.analytic_shape], shapes(), "shape"):
            _check_analytic_budgets(flags, args.analytic_shape, args.budgets, args.skip_measured)
    if not args.skip_measured:
        flags.methods("--methods", args.methods)
        options = {}
        if args.model.startswith("shape:"):
            from promprune.models.shapes import default_options, shapes

            name = args.model.split(":", 1)[1]
            options = default_options(name) if name in shapes() else {}
        capacity = flags.model("--model", args.model, options)
        flags.budgets("--budgets", args.budgets, capacity, args.model)
        flags.dtype("--dtype", args.dtype, allow_auto=True)
        flags.device("--device", args.device, words=("auto",))
        flags.at_least("--batch", args.batch, 1, "images per generate call", 1)
        flags.at_least("--repeats", args.repeats, 1, "timed generate calls", 5)
        flags.at_least("--max-new-tokens", args.max_new_tokens, 1, "tokens generated per call", 16)
        flags.at_least("--graph-pairs", args.graph_pairs, 0, "0: none", 6)
    flags.refuse()


def _check_analytic_budgets(flags: Flags, name: str, budgets, skip_measured: bool) -> None:
    """``--budgets`` against the analytic shape ``name``'s capacity (`shape_analytic`'s rows): each count at most what
    one image gives its LLM, and "none" (unpruned: that capacity) only where the capacity does not depend on the
    image."""
    from promprune.models.adapters import visual_token_capacity
    from promprune.models.shapes import default_options, load

    capacity = visual_token_capacity(load.config(name), default_options(name))
    counts = [b for b in budgets if b is not None]
    if skip_measured:  # the measured arms' check says it otherwise
        flags.at_least("--budgets", counts, 1, "visual tokens")
    over = [b for b in counts if capacity is not None and b > capacity]
    if over:
        flags.add(f"--budgets {' '.join(map(str, over))}", f"--analytic-shape {name} gives an image at most {capacity} "
                  f"visual tokens, so its analytic row would count tokens the model never receives; use counts from "
                  f"1 to {capacity}")
    if capacity is None and None in budgets:
        example = ",".join(map(str, counts)) or "64,32"
        flags.add("--budgets none", f"--analytic-shape {name}'s visual-token count depends on the image (no fixed "
                  f"capacity for the unpruned row), so 'none' has no count to print; give --budgets as counts only, "
                  f"e.g. --budgets {example}, or pick another --analytic-shape")


def measure(vlm, images, prompt, *, repeats: int, max_new_tokens: int) -> dict:
    """Median timings over ``repeats`` generations of a batch (after one warm-up), the peak memory, and how the last
    timed call's certified splits decided (``split``: all of them merged; None where none took the bounds)."""
    prompts = [prompt] * len(images)
    # warm-up: kernels, allocator, caches; with CUDA graphs on, a shape is captured at its second call
    for _ in range(graphed.SIGHTINGS if accel.graphs_on() else 1):
        vlm.generate(images, prompts, max_new_tokens=max_new_tokens)
    device = vlm.model.device
    reset_peak_memory(device)
    tally = graphed.tally()
    runs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with certified.collected() as splits:  # every split of the call (one per budget bucket)
            gens = vlm.generate(images, prompts, max_new_tokens=max_new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        runs.append((gens, (time.perf_counter() - start) * 1e3))
    median = lambda values: statistics.median(values)  # noqa: E731
    select_each = [gens[0].select_ms for gens, _ in runs]
    every = [g for gens, _ in runs for g in gens]
    layers = [g.layer_visual_tokens for g in every]  # an in-LLM method's: each decoder layer's visual tokens
    return {
        "visual_tokens": median([g.visual_tokens for g in every]),
        "layer_visual_tokens": [median(per_layer) for per_layer in zip(*layers)] if all(layers) else None,
        "text_tokens": median([g.text_tokens for gens, _ in runs for g in gens]),
        "vision_ms": median([gens[0].vision_ms for gens, _ in runs]),
        "select_ms": median(select_each),
        "select_each": select_each,
        "prefill_ms": median([gens[0].prefill_ms for gens, _ in runs]),
        "total_ms": median([ms for _, ms in runs]),
        "peak_mem_mb": peak_memory_mb(device),
        "captures_timed": graphed.tally()["captures"] - tally["captures"],  # shapes captured in the timed calls
        "split": certified.SplitReport.total(splits),  # how the last timed call's certified splits decided (None: none)
    }


def paired_graphs(vlm, images, prompt, *, pairs: int, max_new_tokens: int) -> dict:
    """PromPrune's select ms without and with CUDA graphs, interleaved call by call in ABBA order (eager, graphs,
    graphs, eager, ...) after a warm-up of both, so a slow stretch of the machine weighs on both (Table 6's separate
    arms read 17.7 ms eager against 54.1 with graphs on an H200 on 2026-11-28, where the graphs arm's vision and LLM
    prefill were slower too). Returns both lists, the per-pair ratios graphs / eager, the captures made during the
    pairs (0 when the warm-up captured every shape the calls take), and whether every call gave the same answers
    (greedy: the same kept tokens give the same token ids)."""
    prompts = [prompt] * len(images)
    with accel.graphs(True):
        for _ in range(graphed.SIGHTINGS):  # a shape is captured at its SIGHTINGS-th call
            vlm.generate(images, prompts, max_new_tokens=max_new_tokens)
    with accel.graphs(False):
        vlm.generate(images, prompts, max_new_tokens=max_new_tokens)
    before = graphed.tally()["captures"]
    select, answers = {False: [], True: []}, set()
    for i in range(pairs):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            with accel.graphs(on):
                gens = vlm.generate(images, prompts, max_new_tokens=max_new_tokens)
            select[on].append(gens[0].select_ms)
            answers.add(tuple(tuple(g.token_ids) for g in gens))
    return {"eager": select[False], "graphs": select[True],
            "ratios": [g / e for g, e in zip(select[True], select[False])],
            "captures": graphed.tally()["captures"] - before, "same_answers": len(answers) == 1}


def _gib(mib: float | None) -> str:
    """A peak in MiB as GiB with two decimals, '-' where none was measured (CPU off Linux)."""
    return "-" if mib is None else f"{mib / 1024:.2f}"


def print_paired(budget: int, paired: dict) -> None:
    """One line of ``paired_graphs``' outcome."""
    med = statistics.median
    print(f"\npromprune at {budget}, eager and graphs interleaved ({len(paired['eager'])} pairs, ABBA): select ms "
          f"eager {med(paired['eager']):.2f}, graphs {med(paired['graphs']):.2f}; graphs / eager per pair: median "
          f"{med(paired['ratios']):.2f} (min {min(paired['ratios']):.2f}, max {max(paired['ratios']):.2f}); "
          f"captures during the pairs {paired['captures']}; the same answers in every call: {paired['same_answers']}",
          end="")


def _arms(args, graphs: bool = False) -> list[tuple[str | None, int | None, bool]]:
    """(method, budget, CUDA graphs) to measure: the unpruned model once, then every method at every budget; with
    ``graphs`` PromPrune once more with its split's Lanczos stages replayed as CUDA graphs (``accel.graphs``)."""
    arms = [(None, None, False)] if None in args.budgets else []
    for b in args.budgets:
        if b is not None:
            arms += [(m, b, False) for m in args.methods]
            arms += [("promprune", b, True)] if graphs and "promprune" in args.methods else []
    return arms


def measured(args) -> None:
    from promprune.models import PrunedVLM

    base = PrunedVLM.from_pretrained(args.model, method=None, dtype=args.dtype, device_map=args.device)
    options = {}
    if args.model.startswith("shape:"):
        from promprune.models.shapes import default_options

        options = default_options(args.model.split(":", 1)[1])
    text_config = base.model.config.get_text_config()
    images = sample_images(args.batch)
    prompt = "Describe the image briefly."
    device = base.model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"## Measured: {args.model}, batch {args.batch}, {args.repeats} repeats, device {device} ({name}), "
          f"dtype {base.model.dtype}, torch {torch.__version__}\n")
    state = recurrent_state_bytes(text_config, base.model.dtype) / MIB  # per sequence; 0 without linear layers
    print("| method | budget | visual tokens | prefill TFLOPs | KV MiB (visual) | state MiB | vision ms | select ms "
          "| LLM prefill ms | total prefill ms | generate ms | peak GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    splits, paired = [], []
    for method, budget, graphs in _arms(args, graphs=device.type == "cuda"):
        vlm = PrunedVLM(base.model, base.processor, method=method, budget=budget, **options)
        with accel.graphs(graphs):
            m = measure(vlm, images, prompt, repeats=args.repeats, max_new_tokens=args.max_new_tokens)
        if method == "promprune" and m["split"] is not None:  # where the split took the bounds
            graph_state = (f"; graphs kept {len(graphed._CAPTURES)}, captured in the timed calls "
                           f"{m['captures_timed']}, failed {graphed._FAILED or 'none'}" if graphs else "")
            splits.append((budget, graphs, m["split"],
                           " ".join(f"{ms:.1f}" for ms in m["select_each"]) + graph_state))
        if graphs and args.graph_pairs > 0:
            paired.append((budget, paired_graphs(vlm, images, prompt, pairs=args.graph_pairs,
                                                 max_new_tokens=args.max_new_tokens)))
        n_vis, n_text = int(m["visual_tokens"]), int(m["text_tokens"])  # text: the prompt the LLM read
        layer_vis = [int(v) for v in m["layer_visual_tokens"]] if m["layer_visual_tokens"] else None
        flops, kv = generation_cost(text_config, n_vis, n_text, layer_vis, base.model.dtype)  # as the pipeline logs
        tflops, kv = flops / 1e12, kv / MIB
        total = m["vision_ms"] + m["select_ms"] + m["prefill_ms"]  # Table 6's prefill: vision + selection + LLM
        label = (method or "unpruned") + ("+graphs" if graphs else "")
        print(f"| {label} | {budget or 'full'} | {n_vis} | {tflops:.3g} | {kv:.4g} | {state:.4g} | "
              f"{m['vision_ms']:.1f} | {m['select_ms']:.1f} | {m['prefill_ms']:.1f} | {total:.1f} | "
              f"{m['total_ms']:.1f} | {_gib(m['peak_mem_mb'])} |", flush=True)
    for budget, graphs, report, each in splits:  # how PromPrune's certified split decided in the last timed call
        print(f"\npromprune{'+graphs' if graphs else ''} at {budget}: views decided by the bounds per stage "
              f"{report.decided}, by the exact eigensolve {report.exact_note}; select ms per timed call: {each}",
              end="")
    for budget, outcome in paired:
        print_paired(budget, outcome)
    print(f"\ntext tokens per prompt: {n_text} (the processor's prompt without its visual placeholders); state MiB: "
          "the linear-attention layers' recurrent state per sequence, the same at every budget; "
          f"timings are medians per batch of {args.batch}; peak GB is the allocator's high-water mark (GiB) on a "
          "GPU, the peak RSS during the timed calls on CPU (Linux; '-' elsewhere)")
    print()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:llava_next",
                        help="checkpoint, tiny:<arch> or shape:<name> (offline; promprune.models.shapes.shapes())")
    parser.add_argument("--methods", default="promprune", type=comma_list(example="vispruner,divprune,promprune"),
                        help="comma list of methods measured at every budget (Table 6: vispruner,divprune,promprune)")
    parser.add_argument("--budgets", default=None, type=comma_list(_budget, "none,640,320,160"),
                        help="comma list, 'none' = unpruned (default: none,640,320,160; tiny models none,40,20,10)")
    parser.add_argument("--dtype", default=None, help="float16 / bfloat16 / float32 (default: the checkpoint's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1, help="images per generate call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--graph-pairs", type=int, default=6,
                        help="on a GPU, after PromPrune's graphs arm: this many eager / graphs pairs of calls, "
                             "interleaved, for their select ms (0: none)")
    parser.add_argument("--skip-measured", action="store_true", help="only the analytic Table 6")
    parser.add_argument("--skip-analytic", action="store_true", help="only the measured table")
    parser.add_argument("--analytic-shape", default=None,
                        help="also print the analytic rows of this shipped shape's LLM at --budgets (e.g. gemma4_31b)")
    args = parser.parse_args(argv)
    if args.budgets is None:
        args.budgets = [None, 40, 20, 10] if args.model.startswith("tiny:") else [None, 640, 320, 160]
    check_flags(args)
    torch.manual_seed(0)
    if not args.skip_analytic:
        table6_analytic()
        if args.analytic_shape:
            shape_analytic(args.analytic_shape, args.budgets)
    if not args.skip_measured:
        measured(args)


if __name__ == "__main__":
    main()
