"""What a block of requests costs per request outside the model: packing it (the driver) and answering it (an actor).

    python benchmarks/block_overhead.py
    python benchmarks/block_overhead.py --checkout /path/to/another/clone     # the same on other code, to compare
    python benchmarks/block_overhead.py --smoke      # a check of the script (seconds): 4 images, one pass

720 POPE-shaped requests (40 images, 18 questions each, small PNGs) are packed into blocks of 8 rows
(``pack_requests``: one block per image) and every block is answered by ``run_requests`` with a stand-in model that
answers at once, so what is timed is the bookkeeping around the model: decoding each image once, grouping the
questions by image, the shared-image cache and its release (vision once / prefix once, where the checkout has them).
Median of 5 passes. The last line: ``pack ms / request: P, answer ms / request: A``.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

IMAGES, QUESTIONS, BATCH_SIZE, PASSES = 40, 18, 8, 5
SMOKE_IMAGES, SMOKE_PASSES = 4, 1


class InstantModel:
    """Answers every question at once ("yes"), whatever keyword arguments the checkout passes to ``generate``."""

    model = None

    def generate(self, images, prompts, **kwargs):
        from promprune.models.vlm import Generation

        return [Generation(text="yes", visual_tokens=1, saliency_count=0, entropy=None, kept=[0], salient=[],
                           vision_ms=0.0, select_ms=0.0, prefill_ms=0.0, decode_ms=0.0, text_tokens=1)
                for _ in prompts]


def requests(images: int = IMAGES) -> list:
    from PIL import Image

    from promprune.eval.requests import image_key
    from promprune.records import Request

    rows = []
    for i in range(images):
        image = Image.new("RGB", (64, 48), (i * 6, 10, 200 - i * 4))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        png, key = buffer.getvalue(), image_key(image)
        rows += [Request(task="pope", doc_id=len(rows), n_docs=images * QUESTIONS, prompt=f"Is there a thing {k}?",
                         image=png, image_key=key, gen_kwargs={"max_new_tokens": 2})
                 for k in range(QUESTIONS)]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the repository whose promprune is timed (default: this one)")
    p.add_argument("--smoke", action="store_true", help=f"a check of the script: {SMOKE_IMAGES} images, "
                   f"{SMOKE_PASSES} pass")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's benchmarks (its Flags)
    from benchmarks import Flags

    flags = Flags(__file__)
    flags.existing("--checkout", args.checkout, "directory", inside="promprune/__init__.py")
    flags.refuse()
    images, passes = (SMOKE_IMAGES, SMOKE_PASSES) if args.smoke else (IMAGES, PASSES)
    sys.path.insert(0, str(args.checkout))
    import promprune
    from promprune.eval import run_requests
    from promprune.eval.requests import pack_requests

    rows, model = requests(images), InstantModel()
    pack, answer = [], []
    for _ in range(passes):
        start = time.perf_counter()
        blocks = pack_requests(rows, BATCH_SIZE)
        pack.append((time.perf_counter() - start) / len(rows) * 1e3)
        start = time.perf_counter()
        for block in blocks:
            run_requests(model, block, batch_size=BATCH_SIZE)
        answer.append((time.perf_counter() - start) / len(rows) * 1e3)
    print(f"promprune from {Path(promprune.__file__).parent}; {len(rows)} requests in {len(blocks)} blocks")
    print(f"pack ms / request: {statistics.median(pack):.4f}, answer ms / request: {statistics.median(answer):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
