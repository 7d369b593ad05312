"""Calling ``promprune.select`` for a batch of images whose token counts and views differ.

Each image (or, for LLaVA-NeXT per-view modes, each view) is one *unit*; units with equal token count and
budget are stacked into one batched ``select`` call.

LLaVA-NeXT budget modes (``promprune.models.options.ADAPTER_OPTIONS``): ``per_crop`` splits the budget evenly over
the image's views; ``global`` selects once over all views; ``adaptive_views`` gives each view a share proportional
to its spectral entropy (spread-out views get more tokens), then selects per view. In these three a view never gets
more than it has; what it cannot take goes to the others, so every image keeps ``min(budget, N)`` tokens.
``view_quota`` gives every view the same ``view_budget`` whatever the image's view count, and the adapter passes
each view's whole grid (``VisualItem.full``): picks the model's unpadding drops are not fed. ``packed`` is
``global`` over ``VisualItem.packed()``, newline tokens included.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

import promprune

from .adapters import VisualItem


@dataclass
class ItemSelection:
    """``kept [M]`` candidate indices (in the LLM's order), ``merged [M, d]`` or None, ``saliency_count``, ``entropy``,
    ``salient [S]``: the kept candidates the saliency stage chose (ascending; ``S == saliency_count``); ``cls [K, d]``
    or None: kept tokens that are no candidate, fed first (VisionZip's CLS, one per view)."""

    kept: torch.Tensor
    merged: torch.Tensor | None
    saliency_count: int
    entropy: float | None
    salient: torch.Tensor | None = None
    cls: torch.Tensor | None = None


def split_budget(budget: int, counts: list[int], weights: list[float] | None = None) -> list[int]:
    """Integer shares of ``budget`` over views with ``counts`` tokens, proportional to ``weights`` (even if None).

    Largest-remainder rounding; shares are capped at the counts and the excess is re-split over the rest.
    Sums to ``min(budget, sum(counts))``.
    """
    shares = [0] * len(counts)
    open_ = [i for i, c in enumerate(counts) if c > 0]
    left = min(budget, sum(counts))
    while left > 0 and open_:
        w = [max(float(weights[i]), 0.0) if weights is not None else 1.0 for i in open_]
        w = w if sum(w) > 0 else [1.0] * len(open_)
        total = sum(w)
        exact = [left * wi / total for wi in w]
        give = [int(e) for e in exact]
        order = sorted(range(len(open_)), key=lambda j: (-(exact[j] - give[j]), j))
        for j in order[:left - sum(give)]:
            give[j] += 1
        for j, i in enumerate(open_):
            take = min(give[j], counts[i] - shares[i])
            shares[i] += take
            left -= take
        open_ = [i for i in open_ if shares[i] < counts[i]]
    return shares


def _units(items: list[VisualItem], budget: int, mode: str, view_budget: int | None = None):
    """``(item, candidate indices [n], budget, view or None)`` for every selection unit."""
    units = []
    for b, item in enumerate(items):
        views = item.groups.unique().tolist()
        if mode in ("global", "packed") or len(views) == 1 and mode != "view_quota":
            units.append((b, torch.arange(item.features.shape[0], device=item.features.device), budget,
                          views[0] if len(views) == 1 else None))
            continue
        members = [(item.groups == v).nonzero().flatten() for v in views]
        counts = [len(m) for m in members]
        if mode == "view_quota":
            shares = [min(view_budget if view_budget is not None else budget, c) for c in counts]
        else:
            weights = None
            if mode == "adaptive_views":
                weights = [float(promprune.spectral_entropy(item.features[m][None].float())[0]) for m in members]
            shares = split_budget(budget, counts, weights)
        for v, m, share in zip(views, members, shares):
            if share > 0:
                units.append((b, m, share, v))
    return units


def _vision(items: list[VisualItem], group) -> promprune.VisionFeatures | None:
    """The vision tower's features of a bucket of units (None when the adapter has none). A unit of one view gets
    that view's CLS; a unit of several (global modes) the base view's, the whole image's."""
    first = items[group[0][0]]
    if first.vision is None:
        return None
    hidden = torch.stack([items[b].vision[idx] for b, idx, _, _ in group])
    keys = None if first.keys is None else torch.stack([items[b].keys[idx] for b, idx, _, _ in group])
    cls = None
    if first.cls is not None:
        cls = torch.stack([items[b].cls[0 if v is None else v] for b, _, _, v in group])
    return promprune.VisionFeatures(hidden=hidden, keys=keys, cls=cls, project=first.project)


def _instruction(items: list[VisualItem], group) -> promprune.Instruction:
    """The instruction of a bucket of units: each unit's question embedding and its candidates in that space."""
    first = items[group[0][0]]
    if first.text_tokens is None:
        raise ValueError("this method weighs tokens by the instruction: the adapter attaches it "
                         "(Adapter.attach_instruction), which was not called")
    query = torch.stack([items[b].text_query for b, _, _, _ in group])  # [U, c]
    tokens = torch.stack([items[b].text_tokens[idx] for b, idx, _, _ in group])  # [U, n, c]
    return promprune.Instruction(query=query, tokens=tokens, source=first.text_source)


def unit_key(key: int | None, view: int | None) -> int | None:
    """The key of one selection unit: the image's key (a unit of the whole image, ``view`` None), or it combined
    with the view's index (blake2b), so that each view of an image draws on its own."""
    if key is None or view is None:
        return key
    digest = hashlib.blake2b(f"{key}:view{view}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _keys(items: list[VisualItem], group) -> list[int] | None:
    """The units' keys of a bucket (None when an item has no key: ``select`` then fingerprints the features)."""
    keys = [unit_key(items[b].key, v) for b, _, _, v in group]
    return None if any(k is None for k in keys) else keys


NOT_A_RECTANGLE = ("this method pools one view's token grid: the candidates of a selection unit must fill one "
                   "rectangle of one view (LLaVA-NeXT / LLaVA-OneVision: use budget_mode 'per_crop', "
                   "'adaptive_views' or 'view_quota', not 'global' or 'packed')")


def unit_grid(item: VisualItem, idx: torch.Tensor) -> tuple[int, int]:
    """``(rows, cols)`` of the candidates ``idx`` of one unit, which must fill a rectangle of one view's grid in raster
    order (LLaVA's image, a LLaVA-NeXT view after unpadding, Qwen2.5-VL's / Qwen3-VL's merged grid, a LLaVA-OneVision
    view as fed: ``VisualItem.cells``)."""
    grid = item.grid_index[idx]
    if not bool((grid >= 0).all()):  # newline tokens (packed) have no place in a view
        raise ValueError(NOT_A_RECTANGLE)
    if item.cells is not None:  # (row, col) in the grid the view is fed as
        r, c = item.cells[idx].unbind(-1)
        same_view = bool((item.groups[idx] == item.groups[idx[0]]).all())
    elif item.grid_shape is not None:
        rows, cols = item.grid_shape
        cell = grid % (rows * cols)
        r, c = cell // cols, cell % cols
        same_view = bool((grid // (rows * cols) == grid[0] // (rows * cols)).all())
    else:
        raise ValueError("this method pools a token grid: the adapter gives no grid for these tokens")
    height, width = int(r.max() - r.min()) + 1, int(c.max() - c.min()) + 1
    raster = (r - r.min()) * width + (c - c.min())
    if not same_view or height * width != idx.numel() or not torch.equal(raster, torch.arange(idx.numel(),
                                                                                              device=raster.device)):
        raise ValueError(NOT_A_RECTANGLE)
    return height, width


def select_items(items: list[VisualItem], budget: int, method: str, options: dict,
                 mode: str = "per_crop", order: str = "raster", view_budget: int | None = None) -> list[ItemSelection]:
    """Run ``method`` on every image; returns one :class:`ItemSelection` per item, its ``kept`` in ``order``
    ("raster": ascending; "selection": as picked; "stages": salient ascending, then the rest ascending; the views
    of LLaVA-NeXT follow each other in view order). ``view_budget``: each view's tokens under "view_quota".
    Kept candidates outside the run (``run_pos < 0``: padding the model's unpadding drops) are left out."""
    spec = promprune.method_spec(method)
    options = {**options, "order": "ascending" if order == "raster" else "selection"}
    units = _units(items, budget, mode, view_budget)
    results: dict[int, list] = {b: [] for b in range(len(items))}
    buckets: dict[tuple, list] = {}
    for unit in units:
        grid = unit_grid(items[unit[0]], unit[1]) if spec.needs_grid else None
        buckets.setdefault((unit[1].numel(), unit[2], grid), []).append(unit)
    for (_n, share, grid), group in buckets.items():
        feats = torch.stack([items[b].features[idx] for b, idx, _, _ in group])  # [U, n, d]
        sal = None
        if spec.needs_saliency:
            sal = torch.stack([items[b].saliency[idx] for b, idx, _, _ in group])  # [U, n]
        vision = _vision(items, group) if spec.reads_vision else None
        text = _instruction(items, group) if spec.needs_instruction else None
        sel = promprune.select(feats, sal, budget=share, method=method, vision=vision, instruction=text, grid=grid,
                               keys=_keys(items, group), **options)
        for u, (b, idx, _, _) in enumerate(group):
            merged = None if sel.features is None else sel.features[u]
            ent = None if sel.entropy is None else float(sel.entropy[u])
            chosen = sel.indices[u].to(idx.device)
            is_salient = sel.salient[u].to(idx.device) if sel.salient is not None else torch.zeros_like(chosen,
                                                                                                        dtype=bool)
            count = int(sel.saliency_count[u])
            fed = items[b].run_pos[idx[chosen]] >= 0
            if not bool(fed.all()):  # picks in the padding: the model's unpadding drops them
                count -= int((is_salient & ~fed).sum())
                chosen, is_salient = chosen[fed], is_salient[fed]
                merged = None if merged is None else merged[fed]
            if order == "stages":  # salient ascending, then the rest ascending (VisionZip's released order)
                rank = chosen + (~is_salient).long() * (int(chosen.max()) + 1 if chosen.numel() else 0)
                perm = rank.argsort()
                chosen, is_salient = chosen[perm], is_salient[perm]
                merged = None if merged is None else merged[perm]
            salient = idx[chosen[is_salient]]
            cls = None if sel.cls is None else sel.cls[u][None]
            results[b].append((idx[chosen], merged, count, ent, salient, cls))
    return [_combine(results[b], items[b].run_pos, keep_order=order != "raster") for b in range(len(items))]


def _combine(parts, run_pos: torch.Tensor, keep_order: bool = False) -> ItemSelection:
    """Merge the units of one image into one kept list: in run order (the sequence the model packs), or
    (``keep_order``) the units' own orders one after the other (entropy: mean over views; CLS tokens in view
    order)."""
    kept = torch.cat([p[0] for p in parts])
    order = torch.arange(kept.numel(), device=kept.device) if keep_order else run_pos[kept].argsort()
    merged = None
    if parts[0][1] is not None:
        merged = torch.cat([p[1] for p in parts])[order]
    ents = [p[3] for p in parts if p[3] is not None]
    cls = torch.cat([p[5] for p in parts]) if parts[0][5] is not None else None
    return ItemSelection(kept=kept[order], merged=merged, saliency_count=sum(p[2] for p in parts),
                         entropy=sum(ents) / len(ents) if ents else None,
                         salient=torch.cat([p[4] for p in parts]).sort().values, cls=cls)
