"""How long an actor takes to get its model: `from_pretrained` from disk vs. the sweep's object-store weights.

    python benchmarks/model_loading.py                  # a ~0.5 GB LLaVA (random weights), 2 actors
    python benchmarks/model_loading.py --layers 16 --actors 4
    python benchmarks/model_loading.py --layers 1 --hidden 64 --actors 1     # a check of the script (~1 min on 2 cores)

A checkpoint is written once with `save_pretrained` (safetensors, like the hub's). Then, in fresh Ray actors:

- disk:   `LlavaForConditionalGeneration.from_pretrained(path)` in every actor (what each actor of each trial
          would do without sharing; the OS page cache is warm after the first, so this is the *best* case).
- shared: one task loads and publishes the weights (`pipelines.weights.load_for_sharing`, once per sweep);
          each actor then maps them zero-copy from the object store and rebuilds the module on the meta device
          (`pipelines.weights.materialize`).

Prints a table (median over actors) and what a sweep of `--trials` x `--actors` pays each way. Numbers, not
assertions: the ratio grows with the checkpoint (a 7B model reads ~14 GB per disk load).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first, installed or not
from benchmarks import Flags  # noqa: E402


def build_checkpoint(path: Path, layers: int, hidden: int) -> float:
    """A LLaVA of real structure and random weights, saved like a hub checkpoint; returns its size in GB."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                       vocab_size=32064)
    vision = CLIPVisionConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                              image_size=224, patch_size=14)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=32000))
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9


def _touch(model) -> float:
    """Read every weight once (what the first forward pass, or .to("cuda"), does): a lazily mapped file is only
    loaded when touched, so an untouched model would hide the real cost."""
    return float(sum(p.detach().float().sum() for p in model.parameters()))


@ray.remote(num_cpus=1)
class DiskLoader:
    def __init__(self):
        import transformers.models.llava.modeling_llava  # noqa: F401 - imports are not loading time

    def load(self, path: str, dtype: str) -> float:
        from transformers import LlavaForConditionalGeneration

        t0 = time.perf_counter()
        _touch(LlavaForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)))
        return time.perf_counter() - t0


@ray.remote(num_cpus=1)
class SharedLoader:
    def __init__(self):
        import transformers.models.llava.modeling_llava  # noqa: F401

        import pipelines.weights  # noqa: F401

    def load(self, refs: list, dtype: str) -> float:
        from pipelines.weights import materialize

        t0 = time.perf_counter()
        _touch(materialize(ray.get(refs[0]), "cpu")[0])
        return time.perf_counter() - t0


@ray.remote(num_cpus=1, num_returns=2)
def publish(path: str, dtype: str):
    """What pipelines.weights.share does, for a plain checkpoint directory."""
    from transformers import LlavaForConditionalGeneration

    from pipelines.weights import extract

    recipe, arrays = extract(LlavaForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)))
    return (recipe, None, arrays), sum(a.nbytes for a in arrays)


def per_actor(cls, arg, dtype: str, n: int) -> list[float]:
    times = []
    for _ in range(n):  # one actor at a time: on 2 cores, parallel actors would only measure contention
        actor = cls.remote()
        times.append(ray.get(actor.load.remote(arg, dtype)))
        ray.kill(actor)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--actors", type=int, default=2, help="actors measured per path")
    p.add_argument("--trials", type=int, default=19, help="for the sweep estimate (Table 1: 18 trials + baseline)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype the actors run in; the checkpoint is fp32 (bfloat16: a conversion on every load, "
                        "as for fp16 hub checkpoints run in bf16)")
    args = p.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--layers", args.layers, 1, "LLM layers", 8)
    flags.at_least("--hidden", args.hidden, 2, "LLM width", 1024)
    heads = max(1, args.hidden // 64)
    if args.hidden >= 2 and (args.hidden % heads or args.hidden // heads % 2):
        flags.add(f"--hidden {args.hidden}", f"its {heads} attention head(s) of 64 would not split it into even "
                  "head widths; use a multiple of 64 (or an even width below 64), e.g. --hidden 1024")
    flags.at_least("--actors", args.actors, 1, "actors measured per path", 2)
    flags.at_least("--trials", args.trials, 1, "trials of the sweep estimate", 19)
    flags.refuse()

    from pipelines.run.ray_connect import patient_start, worker_env

    with tempfile.TemporaryDirectory(prefix="promprune-ray-") as tmp, tempfile.TemporaryDirectory() as d:
        # a Ray of its own (never a head `ray start` left running), its files in a temp dir of its own
        with patient_start():  # a busy machine's slow node registration is waited for (Ray alone gives it 30 s)
            ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=worker_env(), _temp_dir=tmp)
        gb = build_checkpoint(Path(d), args.layers, args.hidden)
        disk = per_actor(DiskLoader, d, args.dtype, args.actors)
        t0 = time.perf_counter()
        ref, n_bytes = publish.remote(d, args.dtype)
        ray.get(n_bytes)
        publish_s = time.perf_counter() - t0
        shared = per_actor(SharedLoader, [ref], args.dtype, args.actors)
        del ref
        ray.shutdown()
    disk_s, shared_s = statistics.median(disk), statistics.median(shared)
    loads = args.trials * args.actors
    print(f"\ncheckpoint: {gb:.2f} GB fp32 (LLaVA, {args.layers} x {args.hidden} LLM + CLIP), actors run "
          f"{args.dtype}, {args.actors} actors per path, warm page cache\n")
    print(f"| path   | once per sweep | per actor (median) | sweep of {args.trials} trials x {args.actors} actors |")
    print("|--------|---------------:|-------------------:|------------------------------:|")
    print(f"| disk   | {0:14.2f}s | {disk_s:17.2f}s | {loads * disk_s:28.1f}s |")
    print(f"| shared | {publish_s:14.2f}s | {shared_s:17.2f}s | {publish_s + loads * shared_s:28.1f}s |")
    print(f"\nper-actor speed-up: {disk_s / shared_s:.1f}x")


if __name__ == "__main__":
    main()
