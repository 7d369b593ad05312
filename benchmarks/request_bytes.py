"""What a sweep's inputs take in Ray's object store: bytes against requests and distinct images.

    python benchmarks/request_bytes.py [--tasks easyvqa_yesno easyvqa_open] [--limit N] [--batch-size 8]
                                       [--shards K]

Builds the requests exactly as a sweep does (`pipelines.run.requests.build_requests_dataset` on a local Ray: the
driver for small evaluations, K parallel shard tasks for large ones), then sums the Arrow bytes of the stored blocks
(each block sealed in its one-row envelope, as the object store holds it; the rows are counted in the unsealed
blocks). Every image is stored once per block (`promprune.eval.requests.pack_requests`), so the bytes follow the
distinct images, not the questions; the table beside it gives what one PNG per request (the layout before) would
have taken. The default tasks are VQAv2-shaped: easy-vqa asks ~10 questions about each of its 1,000 images across
the two tasks. Hub benchmarks work the same way once their data is in the HF cache (or the stand-ins of
`python -m promprune.eval standins`). The last line is the headline:

    object store bytes B for R requests over I distinct images
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import Flags  # noqa: E402


def measure(tasks: list[str], limit: int | None, batch_size: int, shards: int | None) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    from pipelines.run.requests import build_requests_dataset, unseal

    start = time.perf_counter()
    built = build_requests_dataset(tasks, limit, {}, batch_size, shards=shards)
    build_s = time.perf_counter() - start
    envelopes = ray.get(built.blocks)  # one-row tables, each a sealed block: what the object store holds
    table = pa.concat_tables([block for envelope in envelopes for _, block in unseal(envelope)])
    keys = table.column("image_key")
    carried = pc.invert(pc.is_null(table.column("image")))
    image_bytes = pc.binary_length(table.column("image")).fill_null(0)
    # one PNG per request (the layout before): each request's image at its group's stored size
    size_of = {k: n for k, n, c in zip(keys.to_pylist(), image_bytes.to_pylist(), carried.to_pylist()) if c and k}
    per_request = sum(size_of.get(k, 0) for k in keys.to_pylist())
    return dict(requests=table.num_rows, blocks=len(envelopes), distinct=len(set(k for k in keys.to_pylist() if k)),
                stored_images=int(pc.sum(carried).as_py() or 0), store_bytes=int(sum(e.nbytes for e in envelopes)),
                image_bytes=int(pc.sum(image_bytes).as_py() or 0), per_request_bytes=per_request, build_s=build_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=["easyvqa_yesno", "easyvqa_open"])
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per block, as the sweep's resources.batch_size")
    p.add_argument("--shards", type=int, default=None,
                   help="parallel build tasks (default: as a sweep decides: the driver up to 2,000 rows, else one per "
                        "CPU)")
    args = p.parse_args(argv)
    flags = Flags(__file__)
    flags.at_least("--limit", args.limit, 1, "documents per task; leave it out for all", 100)
    flags.at_least("--batch-size", args.batch_size, 1, "rows per block", 8)
    flags.at_least("--shards", args.shards, 1, "parallel build tasks; leave it out for a sweep's choice", 2)
    if not flags.problems:
        flags.tasks("--tasks", args.tasks, args.limit)
    flags.refuse()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from pipelines.run.ray_connect import init_local

    with tempfile.TemporaryDirectory(prefix="promprune-ray-") as tmp:
        init_local(include_dashboard=False, log_to_driver=False, _temp_dir=tmp)  # as a sweep's local Ray
        try:
            m = measure(args.tasks, args.limit, args.batch_size, args.shards)
        finally:
            ray.shutdown()
    mib = 2 ** 20
    print(f"tasks {' '.join(args.tasks)}, limit {args.limit}, batch size {args.batch_size}, shards {args.shards}")
    print("| requests | distinct images | images stored | blocks | store MiB | image MiB | one PNG per request MiB "
          "| build s | build ms / request |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {m['requests']} | {m['distinct']} | {m['stored_images']} | {m['blocks']} | {m['store_bytes'] / mib:.1f} "
          f"| {m['image_bytes'] / mib:.1f} | {m['per_request_bytes'] / mib:.1f} | {m['build_s']:.1f} "
          f"| {1e3 * m['build_s'] / max(1, m['requests']):.2f} |")
    print(f"object store bytes {m['store_bytes']} for {m['requests']} requests over {m['distinct']} distinct images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
