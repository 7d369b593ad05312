"""Samples per second of an accuracy sweep against one lmms-eval run per configuration: vision once, prefix once.

    python benchmarks/throughput.py            # about 6 minutes of CPU on a 2-core machine, one torch thread
    python benchmarks/throughput.py --smoke    # a check of the script (~80 s on 2 cores): one task, a few questions,
                                               # a smaller model

One checkpoint, saved to a directory so that lmms-eval's own ``llava_hf`` model loads it: LLaVA-1.5-7B's architecture
(``shape:llava_1_5_7b``, random weights, bf16) with both towers shrunk alike so that a CPU runs it, 3 of CLIP's 24
layers and 4 of the LLM's 32 (1/8 of the depth), a quarter of each tower's width (heads of the same width), so the
vision tower costs about what it costs the 7B beside its LLM (printed: the two FLOP ratios). Two tasks, lmms-eval's
own ``pope`` and ``vqav2_val`` on local stand-ins of their hub data (``promprune.eval.standins``), shaped like the
real ones: 18 questions per image (POPE: 9,000 over 500 images; here 4 images) and 5 (VQAv2-val: 214,354 over
40,504; here 6). The answers are as long as the 7B's (POPE "Yes" + end of sequence: 2 tokens; VQAv2 a word or two:
3), which random weights never end on their own: ``max_new_tokens`` is set to that length everywhere (lmms-eval's
``--gen_kwargs``, our requests' ``gen_kwargs``), so every path decodes the same tokens.

Two configurations, the unpruned model and PromPrune at 64 tokens (Table 1's middle budget), each answered by:

  (a) one ``lmms-eval`` process per configuration, as users run it today: ``--model llava_hf`` unpruned, ``--model
      promprune`` pruned (our plugin, its defaults: each request alone), batch size 1 (llava_hf's only one); the
      whole process: imports, task and data loading, model loading, answering and scoring;
  (b) our sweep's path with both options off: the requests built once (``build_requests``), packed into blocks
      (``pack_requests``, 8 rows), the model loaded once for both configurations, every block answered by
      ``run_requests`` (what each Ray actor runs; called here directly, without Ray), batch size 8, and scored;
  (c) the same with ``vision_once``: each image preprocessed, encoded and selected once;
  (d) the same with ``vision_once`` and ``prefix_cache``: its prompt up to the end of the visual tokens prefilled once.

(b)-(d) count the model load and the request build once per task, as a sweep of that task would. Every path runs
with the same torch threads (``--threads``, default 1), configuration by configuration, (a) to (d) in turn. Samples
per second are counted two ways: per wall second, and per CPU second (user + system time of all the path's threads
and processes). With one thread the second is the path's wall time on a core of its own: on a machine shared with
other jobs (the development machine's load average is often 5-10 on 2 cores) wall seconds measure the neighbours as
much as the path, so the last line uses CPU seconds and the tables give both.

Also printed: the answers' agreement between (b), (c) and (d) (bf16 on CPU); the FLOP model (``promprune.efficiency``:
vision tower, prefill, decode and LM head, from each sample's visual and text tokens) beside the measured answering
time of (b)-(d), in wall, CPU and the model's own seconds. (a) and (b) run the same FLOPs per question: what
separates them is the processes' fixed costs and the batch size. Needs lmms-eval's ``llava_hf``, which imports
``decord``: the ``bench`` extra installs it (``pip install -c constraints.txt -e ".[dev,bench]"``). The last line:

    throughput vs one lmms-eval run per configuration: X.Xx pope-shaped, Y.Yx vqav2-shaped

(``--smoke``: the POPE-shaped task alone, so the line names that one.)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import Flags, lmms_eval_problem, pythonpath  # noqa: E402

# LLaVA-1.5-7B shrunk alike in both towers: 24 -> 3 CLIP layers and 32 -> 4 LLM layers (1/8), widths / 4
VISION_LAYERS, TEXT_LAYERS, WIDTH_DIVISOR = 3, 4, 4
# --smoke: 2 CLIP layers (LLaVA reads the penultimate one's output), 1 LLM layer, widths / 16 (a check that every
# path runs and the figures print, not a measurement)
SMOKE_MODEL = (2, 1, 16)
DTYPE = "bfloat16"  # the CPU's bf16 matrix units (AVX512-BF16) run it about 3x faster than fp32
BATCH_SIZE = 8  # the sweeps' resources.batch_size


@dataclass(frozen=True)
class Task:
    """A task of the benchmark: its lmms-eval name, questions per image, images, answer length in tokens."""

    label: str
    name: str
    per_image: int
    images: int
    new_tokens: int
    smoke_questions: int

    def limit(self, smoke: bool) -> int:
        return self.smoke_questions if smoke else self.per_image * self.images


TASKS = (Task("pope-shaped", "pope", 18, 4, 2, 4), Task("vqav2-shaped", "vqav2_val", 5, 6, 3, 5))
SMOKE_TASKS = TASKS[:1]  # --smoke: each task costs two lmms-eval processes, which the paths share nothing with
CONFIGS = (("unpruned", None, None), ("promprune-64", "promprune", 64))
PATHS = {"b": (False, False), "c": (True, False), "d": (True, True)}  # path -> (vision_once, prefix_cache)
PATH_NAMES = {"a": "(a) one lmms-eval run per configuration", "b": "(b) ours, both options off",
              "c": "(c) ours, vision once", "d": "(d) ours, vision and prefix once"}

# The chat template of LLaVA-1.5 ("USER: <image>\n... ASSISTANT:") for a message's content as a list of parts (the
# processor's, ours) or as a string (lmms-eval's llava_hf passes "<image>\n" + the question): the same prompt either way
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% else %}ASSISTANT: {% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{{ c['text'] }}{% endfor %}{% endif %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@dataclass
class Run:
    """One path on one task: wall and CPU seconds per configuration (answering), fixed seconds, samples, answers."""

    answer_s: dict = field(default_factory=dict)
    cpu_s: dict = field(default_factory=dict)
    fixed_s: float = 0.0
    fixed_cpu_s: float = 0.0
    samples: int = 0
    predictions: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.fixed_s + sum(self.answer_s.values())

    @property
    def rate(self) -> float:
        return self.samples / self.total_s

    @property
    def cpu_rate(self) -> float:
        return self.samples / (self.fixed_cpu_s + sum(self.cpu_s.values()))


class Clock:
    """Wall and CPU seconds of a block: this process's threads and the child processes it waited for."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, _cpu() - self.cpu
        return False


def _cpu() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# ---------------------------------------------------------------------------------------------------------------
# setup


def save_checkpoint(directory: Path, smoke: bool = False) -> Path:
    """The benchmark's model, saved the ordinary way (``save_pretrained``) so that both lmms-eval's ``llava_hf`` and
    ``PrunedVLM.from_pretrained`` load it (``smoke``: the smaller :data:`SMOKE_MODEL`)."""
    import torch

    from promprune.models.shapes import shape_vlm

    vision, text, divisor = SMOKE_MODEL if smoke else (VISION_LAYERS, TEXT_LAYERS, WIDTH_DIVISOR)
    model, processor = shape_vlm("llava_1_5_7b", dtype=getattr(torch, DTYPE), text_layers=text,
                                 vision_layers=vision, width_divisor=divisor)
    processor.chat_template = processor.tokenizer.chat_template = TEMPLATE
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def cost_ratios(checkpoint: Path) -> tuple[float, float]:
    """Vision tower / LLM prefill FLOPs of one unpruned LLaVA-1.5 sample (576 visual + 60 text tokens): the
    benchmark's model and the 7B."""
    from transformers import AutoConfig

    from promprune.efficiency import prefill_flops, vision_flops
    from promprune.models.shapes import shape_vlm

    small = AutoConfig.from_pretrained(checkpoint)
    full = shape_vlm("llava_1_5_7b", device="meta")[0].config
    return tuple(vision_flops(c) / prefill_flops(c, 576 + 60) for c in (small, full))


def build_data(hf_home: Path, tasks: tuple[Task, ...], smoke: bool) -> Path:
    from promprune.eval.standins import build_standins

    limit = max(t.limit(smoke) for t in tasks)
    return build_standins(hf_home, tasks=[t.name for t in tasks], docs_per_task=limit,
                          per_image={"pope": TASKS[0].per_image})


# ---------------------------------------------------------------------------------------------------------------
# (a): one lmms-eval process per configuration


def lmms_eval_run(checkpoint: Path, task: Task, limit: int, method, budget, hf_home: Path, out: Path) -> Clock:
    """Wall and CPU seconds of one ``lmms-eval`` process answering ``limit`` documents of ``task``."""
    from promprune.eval.standins import standin_env

    if method is None:  # llava_hf's default device_map "" is refused by transformers 5: name the device
        model, model_args = "llava_hf", f"pretrained={checkpoint},device=cpu,device_map=cpu,dtype={DTYPE}"
    else:
        model = "promprune"
        model_args = f"pretrained={checkpoint},device=cpu,dtype={DTYPE},method={method},budget={budget}"
    command = [sys.executable, "-m", "lmms_eval", "--model", model, "--model_args", model_args, "--tasks", task.name,
               "--limit", str(limit), "--batch_size", "1", "--gen_kwargs", f"max_new_tokens={task.new_tokens}",
               "--output_path", str(out)]
    env = {**os.environ, **standin_env(hf_home), "PYTHONPATH": pythonpath(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with Clock() as clock:
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    problem = f"exit {run.returncode}" if run.returncode else lmms_eval_problem(out, log, [task.name], limit)
    if problem:  # lmms-eval exits 0 after an error it logs, and scores a failed generation as a wrong answer
        hint = ("\nlmms-eval's llava_hf imports decord, which the bench extra installs: "
                "pip install -c constraints.txt -e '.[dev,bench]'" if "decord" in log else "")
        raise RuntimeError(f"lmms-eval {model} on {task.name} did not answer {limit} questions ({problem}):\n"
                           f"{log[-3000:]}{hint}")
    return clock


# ---------------------------------------------------------------------------------------------------------------
# (b)-(d): our path


def run_task(checkpoint: Path, task: Task, limit: int, hf_home: Path, work: Path) -> tuple[dict[str, Run], list,
                                                                                           list]:
    """Every path on ``task`` (and the requests and their blocks), configuration by configuration: its lmms-eval
    process (a), then (b), (c), (d), so that the load of a shared machine falls on all of them alike. Ours: the
    requests built once, the model loaded once, every block answered by ``run_requests`` and scored."""
    import torch

    from promprune.eval import build_requests, run_requests, score
    from promprune.eval.requests import pack_requests
    from promprune.eval.standins import serving
    from promprune.models import PrunedVLM

    with serving(hf_home):
        with Clock() as load:
            base = PrunedVLM.from_pretrained(str(checkpoint), method=None, dtype=DTYPE)
        with Clock() as build:
            rows = build_requests([task.name], limit=limit)
            for row in rows:  # as a sweep spec's generation: {max_new_tokens: ...} is laid over the task's own
                row.gen_kwargs = {**row.gen_kwargs, "max_new_tokens": task.new_tokens}
            blocks = pack_requests(rows, BATCH_SIZE)
        runs = {"a": Run(samples=limit * len(CONFIGS))}
        runs.update({path: Run(fixed_s=load.wall + build.wall, fixed_cpu_s=load.cpu + build.cpu,
                               samples=limit * len(CONFIGS)) for path in PATHS})
        for label, method, budget in CONFIGS:
            clock = lmms_eval_run(checkpoint, task, limit, method, budget, hf_home, work / f"lmms-{task.name}-{label}")
            runs["a"].answer_s[label], runs["a"].cpu_s[label] = clock.wall, clock.cpu
            vlm = base if method is None else PrunedVLM(base.model, base.processor, method=method, budget=budget)
            for path, (vision_once, prefix_cache) in PATHS.items():
                with Clock() as clock, torch.inference_mode():
                    preds = [p for block in blocks for p in run_requests(vlm, block, batch_size=BATCH_SIZE,
                                                                         vision_once=vision_once,
                                                                         prefix_cache=prefix_cache)]
                    score(preds)
                failed = [p.error for p in preds if p.failed]
                if failed:  # the figures would count failures as answers: stop, saying why
                    raise RuntimeError(f"path ({path}) {label} on {task.name}: {len(failed)} of {len(preds)} samples "
                                       f"failed, the first: {failed[0]}")
                runs[path].answer_s[label], runs[path].cpu_s[label] = clock.wall, clock.cpu
                runs[path].predictions[label] = preds
    return runs, rows, blocks


# ---------------------------------------------------------------------------------------------------------------
# the FLOP model


def head_tokens(checkpoint: Path, prompt: str) -> int:
    """Prompt tokens before the image placeholder (the part of the prefix that is not visual)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": prompt}]}],
                                         add_generation_prompt=True, tokenize=False)
    ids = processor.tokenizer(text)["input_ids"]
    return ids.index(processor.tokenizer.convert_tokens_to_ids("<image>"))


def flops(config, preds, keys: dict, path: str, new_tokens: int, head: int) -> float:
    """FLOPs of answering ``preds`` on ``path``: vision tower per question (b) or per image (c, d); the whole prompt
    per question (b, c), or each image's prefix once and each question's suffix over it (d); decode and LM head.
    ``keys``: (task, doc_id) -> the request's image key."""
    from promprune.efficiency import decode_flops, lm_head_flops, prefill_flops, vision_flops

    total, images = 0.0, set()
    for p in preds:
        prompt = p.visual_tokens + p.text_tokens
        first = keys[p.task, p.doc_id] not in images
        images.add(keys[p.task, p.doc_id])
        if path == "b" or first:
            total += vision_flops(config)
        if path == "d":
            prefix = p.visual_tokens + head
            total += (prefill_flops(config, prefix) if first else 0.0) + prefill_flops(config, prompt - prefix, prefix)
        else:
            total += prefill_flops(config, prompt)
        total += decode_flops(config, prompt, new_tokens) + lm_head_flops(config, new_tokens)
    return total


# ---------------------------------------------------------------------------------------------------------------
# run and report


def model_seconds(preds: list, blocks: list) -> float:
    """The model's seconds over ``preds`` (in block order): every batch of ``BATCH_SIZE`` rows of a block reports its
    vision, selection, prefill and decode milliseconds on each of its rows; count them once per batch."""
    total, at = 0.0, 0
    for block in blocks:
        for start in range(0, len(block), BATCH_SIZE):
            p = preds[at + start]
            total += (p.vision_ms or 0) + (p.select_ms or 0) + (p.prefill_ms or 0) + (p.decode_ms or 0)
        at += len(block)
    return total / 1e3


def agreement(a: list, b: list) -> str:
    same = sum(x.prediction == y.prediction for x, y in zip(a, b))
    return f"{same}/{len(a)}"


def report(task: Task, limit: int, runs: dict[str, Run], config, keys: dict, head: int,
           blocks: list) -> tuple[float, float]:
    """Print the task's tables; returns (d)'s throughput over (a)'s, per CPU second and per wall second."""
    a = runs["a"]
    print(f"\n## {task.label}: lmms-eval `{task.name}` on stand-ins, {limit} questions over "
          f"{-(-limit // task.per_image)} images ({task.per_image} per image), answers of {task.new_tokens} tokens, "
          "2 configurations\n")
    print("| path | unpruned s | promprune-64 s | fixed s | samples/s | vs (a) | CPU s | vs (a), CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, run in runs.items():
        cells = " | ".join(f"{run.answer_s[label]:.1f}" for label, _, _ in CONFIGS)
        cpu = run.fixed_cpu_s + sum(run.cpu_s.values())
        print(f"| {PATH_NAMES[key]} | {cells} | {run.fixed_s:.1f} | {run.rate:.2f} | {run.rate / a.rate:.1f}x | "
              f"{cpu:.0f} | {run.cpu_rate / a.cpu_rate:.1f}x |")
    print("\n(a): each process's wall time (its imports, data, model load and scoring included; fixed: 0); (b)-(d): "
          "answering and scoring per configuration, fixed = model load + request build, once. CPU s: user + system "
          "seconds of all threads (what a shared machine's load does not inflate).")
    print("\nanswers equal to (b)'s (bf16): " + ", ".join(
        f"{k} {label} {agreement(runs['b'].predictions[label], runs[k].predictions[label])}"
        for k in ("c", "d") for label, _, _ in CONFIGS))
    print("\n| FLOP model vs measured answering | TFLOP | s | CPU s | model s | (b) / path: FLOPs | s | CPU s | "
          "model s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ours = {k: runs[k] for k in PATHS}
    model = {k: sum(flops(config, r.predictions[label], keys, k, task.new_tokens, head) for label, _, _ in CONFIGS)
             for k, r in ours.items()}
    wall = {k: sum(r.answer_s.values()) for k, r in ours.items()}
    cpu = {k: sum(r.cpu_s.values()) for k, r in ours.items()}
    inside = {k: sum(model_seconds(r.predictions[label], blocks) for label, _, _ in CONFIGS) for k, r in ours.items()}
    for key in ours:
        print(f"| {PATH_NAMES[key]} | {model[key] / 1e12:.2f} | {wall[key]:.1f} | {cpu[key]:.0f} | "
              f"{inside[key]:.1f} | {model['b'] / model[key]:.2f} | {wall['b'] / wall[key]:.2f} | "
              f"{cpu['b'] / cpu[key]:.2f} | {inside['b'] / inside[key]:.2f} |")
    print("\nmodel s: the model's own time (vision tower, selection, prefill, decode: each batch's stopwatches), "
          "without the image processor, the prompts and Python around them.")
    return runs["d"].cpu_rate / a.cpu_rate, runs["d"].rate / a.rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a check of the script: the POPE-shaped task alone, 4 "
                   "questions, 2 CLIP layers and 1 LLM layer, widths / 16 (SMOKE_TASKS, SMOKE_MODEL)")
    p.add_argument("--workdir", type=Path, default=None, help="checkpoint, stand-ins and lmms-eval output (default: "
                                                                 "a temporary directory)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every path, lmms-eval's processes included (default 1: on a shared machine "
                        "two threads wait on each other's barriers whenever another job holds a core)")
    args = p.parse_args(argv)
    flags = Flags(__file__)
    flags.writable("--workdir", args.workdir, "directory")
    flags.at_least("--threads", args.threads, 1, "torch threads of every path", 1)
    flags.refuse()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # lmms-eval's processes inherit it
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="promprune-throughput-") as tmp:
        work = args.workdir or Path(tmp)
        checkpoint = save_checkpoint(work / "checkpoint", args.smoke)
        tasks = SMOKE_TASKS if args.smoke else TASKS
        hf_home = build_data(work / "hf", tasks, args.smoke)
        small, full = cost_ratios(checkpoint)
        vision, text, divisor = SMOKE_MODEL if args.smoke else (VISION_LAYERS, TEXT_LAYERS, WIDTH_DIVISOR)
        print(f"# throughput: LLaVA-1.5-7B shape, {vision}/24 CLIP and {text}/32 LLM layers, widths / {divisor}, "
              f"{DTYPE}, random weights; {torch.get_num_threads()} torch thread(s) per path")
        print(f"vision tower / LLM prefill FLOPs of an unpruned sample: {small:.3f} here, {full:.3f} on the 7B")
        config = AutoConfig.from_pretrained(checkpoint)
        ratios = []
        for task in tasks:
            limit = task.limit(args.smoke)
            runs, rows, blocks = run_task(checkpoint, task, limit, hf_home, work)
            keys = {(r.task, r.doc_id): r.image_key for r in rows}
            ratios.append(report(task, limit, runs, config, keys, head_tokens(checkpoint, rows[0].prompt), blocks))
    print(json.dumps({t.label: {"per CPU second": round(cpu, 2), "per wall second": round(wall, 2)}
                      for t, (cpu, wall) in zip(tasks, ratios)}))
    print("throughput vs one lmms-eval run per configuration: "
          + ", ".join(f"{cpu:.1f}x {t.label}" for t, (cpu, _) in zip(tasks, ratios)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
