"""Shrinking each prompt's image placeholder run to the kept visual tokens."""
from __future__ import annotations

import torch


def placeholder_columns(input_ids: torch.Tensor, image_token_id: int, contiguous: bool = True) -> list[torch.Tensor]:
    """Columns of the image placeholder run of each row: ``input_ids [B, L] -> B x [P_i]``.

    One image per prompt, so the run is contiguous; anything else is a ValueError naming the row. ``contiguous=False``:
    the placeholders may come in several runs (Qwen3-VL's clip: one run per temporal patch, timestamps between).
    """
    runs = []
    for b, row in enumerate(input_ids):
        cols = (row == image_token_id).nonzero().flatten()
        if cols.numel() == 0 or contiguous and int(cols[-1] - cols[0]) + 1 != cols.numel():
            raise ValueError(f"prompt {b}: expected one contiguous image placeholder run, found {cols.numel()} "
                             f"image tokens")
        runs.append(cols)
    return runs


def shrink_placeholders(input_ids: torch.Tensor, attention_mask: torch.Tensor, image_token_id: int,
                        kept_run_pos: list[torch.Tensor], pad_token_id: int, keep_order: bool = False,
                        contiguous: bool = True):
    """Keep only placeholders ``kept_run_pos[b] [M_b]`` (positions within row b's run); re-pad on the left.

    Returns ``(input_ids [B, L'], attention_mask [B, L'], col_map [B, L'])`` where ``col_map`` holds each new
    column's column in the old sequence (-1 for new padding). Text tokens and their order are untouched. The kept
    placeholders stay where the run was; with ``keep_order`` the i-th of them maps to the column of the i-th kept
    position as given (the features fill the run in that order, so each keeps its own original position, e.g.
    Qwen2.5-VL's 3D M-RoPE), else in ascending column order. ``contiguous``: as :func:`placeholder_columns`.
    A position at or past the run's length adds a placeholder after the run's last one, its ``col_map`` that column
    (LLaVA-NeXT's ``unpad=False`` layout can feed more tokens than the unpadded prompt holds; LLaVA numbers the
    sequence itself, so only the count matters there).
    """
    runs = placeholder_columns(input_ids, image_token_id, contiguous)
    kept_cols = []
    for b, (run, pos) in enumerate(zip(runs, kept_run_pos)):
        real = attention_mask[b].bool().clone()
        real[run] = False
        pos = pos if pos.device == run.device else pos.to(run.device)
        chosen = run[pos.clamp(max=run.numel() - 1)]  # past the run: its last column, repeated
        inside = pos < run.numel()
        real[chosen[inside]] = True
        cols = real.nonzero().flatten()
        added = int((~inside).sum())
        if added:
            at = int(torch.searchsorted(cols, run[-1], right=True))
            cols = torch.cat([cols[:at], run[-1:].repeat(added), cols[at:]])
        if keep_order:
            cols[torch.isin(cols, run)] = chosen  # the run's slots are contiguous: reorder within them
        kept_cols.append(cols)
    width = max(c.numel() for c in kept_cols)
    B = input_ids.shape[0]
    col_map = torch.full((B, width), -1, dtype=torch.long, device=input_ids.device)
    for b, cols in enumerate(kept_cols):
        col_map[b, width - cols.numel():] = cols
    new_mask = (col_map >= 0).to(attention_mask.dtype)
    new_ids = input_ids.gather(1, col_map.clamp_min(0)).masked_fill(col_map < 0, pad_token_id)
    return new_ids, new_mask, col_map
