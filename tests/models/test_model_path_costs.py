"""The model path around the selection on the GPU's cost model, counted on the CPU (``benchmarks/launches.py``'s
``count_model``): ``PrunedVLM.prepare`` waits on the device a fixed number of times per batch, whatever the views,
selection units or tokens, never meets a host tensor with a device one, and adds a pinned number of launches around
the bare ``select`` calls."""
from __future__ import annotations

import pytest

from benchmarks.model_path import images, prepare_costs, select_costs
from promprune.models import PrunedVLM

PROMPT = "What is in the picture?"


def costs(name: str, method: str | None, batch: int, budget: int | None = None, **options):
    vlm = PrunedVLM.from_pretrained(name, method=method, budget=budget, **options)
    shots = images(batch)
    prompts = [PROMPT] * batch
    views = [len(item.groups.unique()) for item in vlm.prepare(shots, prompts).items]
    return vlm, shots, prompts, prepare_costs(vlm, shots, prompts), views


def ours(c) -> int:
    """Syncs in promprune's own code (the rest are the model's: LLaVA-NeXT's get_image_features makes one)."""
    return sum(n for site, n in c.sync_sites.items() if site.startswith("promprune/"))


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:llava_next"])
def test_syncs_per_batch_do_not_grow_with_images_views_or_units(name):
    counted = [costs(name, "divprune", batch, 12) for batch in (1, 2, 3)]
    views = [sum(v) for *_, v in counted]
    assert name == "tiny:llava" or views == [5, 8, 13], views  # 1, 3 and 4 selection buckets on LLaVA-NeXT
    for *_, c, _v in counted:
        assert ours(c) == 2, c.sync_sites  # one finiteness read for all buckets, one read of all their results
        assert not [op for op in c.ops if op.startswith("implicit:")], c.ops  # no host index meets a device tensor
    assert len({c.syncs for *_, c, _v in counted}) == 1, [c.sync_sites for *_, c, _v in counted]


def test_vision_once_waits_as_often():
    """Questions sharing an image (``keys``: each image encoded and selected once, its rows spliced on the host)."""
    from benchmarks.launches import count_model, fast_path_on_cpu, on_host

    vlm = PrunedVLM.from_pretrained("tiny:llava_next", method="divprune", budget=12)
    first, second = images(2)
    shots, prompts, keys = [first, first, second, second], ["What?", "Colour?", "Where?", "Why?"], [0, 0, 1, 1]
    with fast_path_on_cpu(), on_host(vlm, "processed"):
        c = count_model(vlm.model, vlm.prepare, shots, prompts, keys=keys)
    assert ours(c) == 2, c.sync_sites


def test_the_unpruned_path_never_waits():
    *_, c, _views = costs("tiny:llava", None, 2)
    assert c.syncs == 0, c.sync_sites


# Launches around the bare select calls: prepare's launches less the unpruned prepare's and the select calls' own.
# Pinned for these tiny configurations: a loop per token or per view would add dozens.
AROUND = {("tiny:llava", "divprune", 1): 13, ("tiny:llava_next", "divprune", 2): 32,
          ("tiny:llava", "visionzip", 2): 44}


@pytest.mark.parametrize("name,method,batch", list(AROUND))
def test_launches_around_the_selection_are_pinned(name, method, batch):
    vlm, shots, prompts, c, _views = costs(name, method, batch, 12)
    *_, unpruned, _ = costs(name, None, batch)
    bare = select_costs(vlm, shots, prompts)
    assert c.launches - unpruned.launches - bare.launches == AROUND[name, method, batch], c.ops.most_common(20)


# eager: three launches a Lanczos step since the sixth stop of 2026-11-28 (``lanczos_triton``: the product, the dot's
# shares, the update; the first step two, with no start matrix formed), seven before, and the Gram's centering and
# rho in two launches, eleven before; and since the ninth stop the two stages after the split in two kernels
# (``greedy_triton.salient_front``, the DPP after it) where ~30 torch ops ran, the cosine in one where eleven ran:
# eager 194 / 430 before them. The graphs' count is the same (a stage is one replay either way). Since 2026-11-29 the
# eager split opens with the lead's 6 steps (``certified.schedule``): 153 -> 159 (an image there goes on to a second
# stage: its read, the stage's end, the copy of its rows) and 325 -> 271 (views that decide after 6 steps, not 12);
# and the ascending order at the end of each select one kernel, not a sort and a gather: 159 -> 158 (graphs 113 -> 112)
# and 271 -> 268 (205 -> 202: three selects). Since the second stop of 2026-11-29 a step of these small views is one
# launch (``lanczos_triton._fused_kernel``: the update and the next product), the lead's 6 steps 7 launches, not 18:
# 158 -> 136 and 268 -> 235; the graphs' count is the same. And the first fused step makes rho where it reads it (no
# launch of its own, ``lanczos_triton.opening_from_gram``): 136 -> 135 and 235 -> 232, one a first stage. Since
# 2026-12-07 the first stage also flags the rows whose centering in Gram space cancels (``entropy.cancels``, joined to
# its coefficients for the one read): nine launches a select eagerly, 135 -> 144 and 232 -> 259; inside the graph, none
@pytest.mark.parametrize("name,launches", [("tiny:llava", (144, 112)), ("tiny:llava_next", (259, 202))])
def test_with_graphs_the_model_path_launches_fewer_and_waits_no_more(name, launches):
    """PromPrune's selection as CUDA graphs inside ``prepare`` (the split's bounds forced: the tiny views are below
    the size "auto" takes them at): fewer launches, no more reads of the device (the eager schedule's stage ends are
    the graphs' and the lead's), no read inside a graph's body, and the same LLM inputs."""

    from benchmarks.launches import fast_path_on_cpu, on_host
    from promprune.selection import accel

    vlm = PrunedVLM.from_pretrained(name, method="promprune", budget=12)
    shots, prompts = images(2), [PROMPT] * 2
    with accel.entropy("certified"):
        eager, graphs = (prepare_costs(vlm, shots, prompts, graphs=g) for g in (False, True))
        prepared = []
        for g in (False, True):
            with fast_path_on_cpu(graphs=g), on_host(vlm, "processed"):
                prepared.append(vlm.prepare(shots, prompts).model_kwargs)
    assert (eager.launches, graphs.launches) == launches, graphs.ops
    assert graphs.syncs <= eager.syncs and set(graphs.sync_sites) <= set(eager.sync_sites)
    assert not [op for op in graphs.ops if op.startswith("breaks capture")], graphs.ops
    assert _same(*prepared)


def _same(a, b) -> bool:
    """Whether two nests of tensors, containers and plain values are equal, tensors element for element."""
    import dataclasses

    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and _same(dataclasses.asdict(a), dataclasses.asdict(b))
    return a == b


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:llava_next"])
def test_downsample_copies_nothing_to_the_device_per_call(name):
    """The pooling matrices stay on the device (``controls.pooling_matrix``): downsample's path reads the device as
    often as DivPrune's, and no copy of them waits (two blocking copies a call before; the counter crashed on their
    ``.to(copy=True)``)."""
    for batch in (1, 2):
        *_, c, _views = costs(name, "downsample", batch, 12)
        assert ours(c) == 2, c.sync_sites
        assert not [site for site in c.sync_sites if "controls.py" in site], c.sync_sites


def test_adaptive_views_weighs_the_views_with_one_eigensolve():
    """``adaptive_views``' entropies: one batched eigensolve for the batch's views of one size (its error check one
    wait on CUDA) and one read, whatever the views (an eigensolve and a finiteness read per view before)."""
    for batch in (1, 2, 3):
        *_, c, views = costs("tiny:llava_next", "divprune", batch, 12, budget_mode="adaptive_views")
        assert ours(c) == 4, (views, c.sync_sites)  # the entropies' eigensolve and read, the buckets' check and read


def test_adaptive_views_with_certified_brackets_runs_no_eigensolve():
    """With the bounds taken (forced: the tiny views are below the size "auto" takes them at), ``adaptive_views``'
    shares come from certified brackets (``batched_select.certain_shares``): where they decide every image, no
    eigensolve runs and the host reads once a Lanczos stage, and the LLM gets the exact route's inputs."""
    import promprune.models.batched_select as batched_select
    from benchmarks.launches import fast_path_on_cpu, on_host
    from promprune.selection import accel

    for batch in (1, 3):
        prepared = {}
        for route in ("exact", "certified"):
            with accel.entropy(route):
                vlm, shots, prompts, c, _views = costs("tiny:llava_next", "divprune", batch, 12,
                                                       budget_mode="adaptive_views")
                with fast_path_on_cpu(), on_host(vlm, "processed"):
                    prepared[route] = vlm.prepare(shots, prompts).model_kwargs
            eigensolves = sum(n for op, n in c.ops.items() if "eigvalsh" in op)
            if route == "exact":
                assert eigensolves == 1 and batched_select.LAST_SHARES == [], c.ops
                continue
            report = batched_select.LAST_SHARES[0]
            assert report.exact == 0 and sum(report.decided) == sum(_views), report  # every view by its brackets
            assert eigensolves == 0, c.ops
            reads = sum(n for site, n in c.sync_sites.items() if "certified.py" in site)
            assert reads == len(report.decided), c.sync_sites
        assert _same(prepared["exact"], prepared["certified"])


def _generate_costs(name, method, batch):
    from benchmarks.launches import count_model, fast_path_on_cpu, on_host

    vlm = PrunedVLM.from_pretrained(name, method=method, budget=12 if method else None)
    shots, prompts = images(batch), [PROMPT] * batch
    with fast_path_on_cpu(), on_host(vlm, "processed"):
        return count_model(vlm.model, vlm.generate, shots, prompts, max_new_tokens=3, min_new_tokens=3)


@pytest.mark.parametrize("method,reads", [(None, 1), ("divprune", 3), ("fastv", 2)])
def test_generate_reads_its_answers_once(method, reads):
    """``generate`` counted whole (transformers' ``generate`` moves tensors with ``.to(copy=True)`` every step, which
    the counter refused): after ``prepare``'s reads, the answers, their text tokens and their NaN flags come back in
    one read (a read per row and two more before), and an in-LLM method's stats in one more (a read per row and per
    hooked layer before), whatever the rows. (FastV's prefill reads per row are counted apart: its loops.)"""
    for batch in (1, 3):
        c = _generate_costs("tiny:llava", method, batch)
        assert sum(n for site, n in c.sync_sites.items() if "transfer.py" in site) == reads, c.sync_sites
        assert not [site for site in c.sync_sites if site.startswith("promprune/") and "transfer.py" not in site
                    and "llm_hooks.py" not in site], c.sync_sites
        assert not [site for site in c.sync_sites if " stats" in site], c.sync_sites


@pytest.mark.parametrize("batch", [1, 3])
def test_promprune_under_adaptive_views_brackets_each_view_once(batch):
    """PromPrune under ``adaptive_views`` with the bounds taken (forced): the shares' certified intervals reach its
    split (``select(..., entropy_bounds=)``), which takes every view's t_sal they decide from them: no second
    bracket (the host reads only the shares' Lanczos stages, once a stage), no eigensolve, every unit counted as
    ``known`` in the split's report, and the LLM gets the exact route's inputs. (Before, every bucket's ``select``
    bracketed its views again: a read a stage more per bucket, the lead's steps and more for every view.)"""
    import promprune.models.batched_select as batched_select
    from benchmarks.launches import fast_path_on_cpu, on_host
    from promprune.selection import accel, certified

    prepared = {}
    for route in ("exact", "certified"):
        with accel.entropy(route):
            vlm, shots, prompts, c, views = costs("tiny:llava_next", "promprune", batch, 12,
                                                  budget_mode="adaptive_views")
            with fast_path_on_cpu(), on_host(vlm, "processed"), certified.collected() as reports:
                prepared[route] = vlm.prepare(shots, prompts).model_kwargs
        if route == "exact":
            continue
        shares = batched_select.LAST_SHARES[0]
        assert shares.exact == 0 and sum(shares.decided) == sum(views), shares  # the shares by their brackets
        assert sum(n for op, n in c.ops.items() if "eigvalsh" in op) == 0, c.ops
        reads = sum(n for site, n in c.sync_sites.items() if "certified.py" in site)
        assert reads == len(shares.decided), c.sync_sites  # the shares' stages alone
        report = certified.SplitReport.total(reports)
        assert sum(report.decided) == 0 and report.exact == 0, report  # no view bracketed or eigensolved again
        assert report.known == sum(views), report
    assert _same(prepared["exact"], prepared["certified"])
