"""In-LLM pruning baselines, FastV and SparseVLM, as hooks on the language model's decoder layers.

The language model is not forked: forward pre-hooks on its decoder layers shrink the sequence between layers.

- A hook on the self-attention of layer ``l - 1`` recomputes the attention rows the method ranks by (queries:
  FastV the last token; SparseVLM the text raters after the image) with the module's own projections and rotary
  embedding, so the LLM keeps SDPA everywhere.
- A hook on layer ``l`` drops visual tokens from the hidden states, gathers the rotary embeddings at the kept
  columns (positions stay the original ones, as FastV's code does), and hands every later layer a mask built for
  the kept columns. The KV cache of layers ``>= l`` therefore holds only kept tokens; during decoding the same
  hooks give those layers masks over their own kept columns plus the generated tokens.

Qwen3-VL's DeepStack adds visual features to the image positions' hidden states after its first LLM layers; once
a layer has pruned, the addition goes to the kept image columns only (each gets its own rows).

Rows of a batch may hold different numbers of visual tokens (LLaVA-NeXT, Qwen2.5-VL); all rows keep the same
sequence length, padded with masked "dead" tokens that nobody attends to.
In-LLM methods see the unpruned sequence, LLaVA-NeXT's ``image_newline`` tokens included, as visual tokens.

SparseVLM, as implemented here (simplifications of its paper and released code, documented):
pruning at the configured layers (default: LLaMA-32's 2, 6, 15 as fractions of the depth) to a geometric
schedule ending at ``budget`` (option ``schedule="released"``: the released code's per-layer counts, where a budget
is a layer-averaged count, e.g. 64 -> 66 / 30 / 17 tokens); raters are the text tokens after the image whose attention to the visual tokens is
at least their mean; a visual token's score is its attention from the raters (head and rater mean), computed
from the layer before each pruning layer. Recycling: of each stage's deleted tokens the top ``recycle_ratio`` by
score are grouped around the ``ceil(merge_ratio * n)`` best of them by cosine similarity of hidden states, and
each group's mean replaces its centre token's hidden state (the centre keeps its position); recycled tokens
count toward the stage's budget. Its paper clusters with density-peak kNN; we use best-score centres.
"""
from __future__ import annotations

import math
import sys

import torch

import promprune
from promprune.selection.in_llm import SPARSEVLM_RELEASED

# Pruning layers of SparseVLM's released code on LLaMA-based LLaVA (32 layers), kept as fractions of the depth.
SPARSEVLM_LAYERS_OF_32 = (2, 6, 15)


def make(method: str, model, input_ids: torch.Tensor, budget: int, options: dict) -> "InLLMPruner":
    """A context manager that prunes inside ``model``'s LLM during ``generate`` on ``input_ids [B, L]``."""
    opts = promprune.method_spec(method).resolve(options, budget=budget)
    layers = _decoder_layers(model)
    impl = model.config.text_config._attn_implementation or "sdpa"
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"{method} needs the LLM's attention as 'sdpa' or 'eager', got {impl!r}")
    if method == "fastv":
        if not 1 <= opts["layer"] < len(layers):
            raise ValueError(f"fastv option 'layer' must be in [1, {len(layers) - 1}], got {opts['layer']}")
        stages = [Stage(opts["layer"], budget, queries="last")]
    else:
        at = opts["layers"] or sparsevlm_layers(len(layers))
        if max(at) >= len(layers):
            raise ValueError(f"sparsevlm option 'layers' must be < {len(layers)} (LLM depth), got {at}")
        targets = [None] * len(set(at))  # None: the geometric schedule
        if opts["schedule"] == "released":  # the budget is one of the released ones (the registry's check)
            if len(set(at)) != 3:
                raise ValueError(f"sparsevlm's released schedule prunes at three layers; this {len(layers)}-layer "
                                 f"LLM gives {sorted(set(at))}: pass option 'layers' with three layers")
            targets = list(SPARSEVLM_RELEASED[budget])
        stages = [Stage(layer, target, queries="raters", recycle=opts["recycle_ratio"], merge=opts["merge_ratio"])
                  for layer, target in zip(sorted(set(at)), targets)]
    return InLLMPruner(model, layers, input_ids, budget, stages, eager=impl == "eager")


def sparsevlm_layers(depth: int) -> list[int]:
    """SparseVLM's pruning layers scaled from 32 to ``depth`` layers (each >= 1, unique, ascending)."""
    return sorted({min(max(1, round(l * depth / 32)), depth - 1) for l in SPARSEVLM_LAYERS_OF_32})


def _decoder_layers(model):
    return model.model.language_model.layers


class _Unwrap:
    """A handle that removes an instance attribute set over a method (restoring the class's method)."""

    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        self.obj.__dict__.pop(self.name, None)


class Stage:
    """Prune before decoder layer ``layer`` down to ``target`` visual tokens (None: per-row geometric schedule)."""

    def __init__(self, layer, target, queries, recycle=0.0, merge=0.0):
        self.layer, self.target, self.queries, self.recycle, self.merge = layer, target, queries, recycle, merge
        self.scores = None  # [B, L_cur] attention received by each current column (set by the hook at layer-1)


class InLLMPruner:
    """Hooks that prune visual tokens inside the LLM; use as ``with pruner: model.generate(...)``."""

    def __init__(self, model, layers, input_ids, budget, stages, eager):
        self.model, self.layers, self.stages, self.eager = model, layers, stages, eager
        self.visual = input_ids == model.config.image_token_id  # [B, L]
        self.prompt_len = input_ids.shape[1]
        self.budget = budget
        counts = self.visual.sum(1).tolist()  # visual tokens of each row
        for s, stage in enumerate(stages, start=1):
            stage.targets = [self._schedule(budget, n, s, len(stages)) if stage.target is None else stage.target
                             for n in counts]
        self.first = stages[0].layer
        self.handles = []

    @staticmethod
    def _schedule(budget: int, n: int, s: int, stages: int) -> int:
        """Tokens a row with ``n`` visual tokens keeps after stage ``s`` of ``stages``: geometric from n to budget."""
        if s == stages or n <= budget:
            return budget
        return max(budget, round(n * (budget / n) ** (s / stages)))

    # ---- context manager -------------------------------------------------------------------------------
    def __enter__(self):
        lm = self.model.model.language_model
        self.handles.append(lm.register_forward_pre_hook(self._on_lm, with_kwargs=True))
        for stage in self.stages:
            attn = self.layers[stage.layer - 1].self_attn
            self.handles.append(attn.register_forward_pre_hook(self._scorer(stage), with_kwargs=True))
        for idx in range(self.first, len(self.layers)):
            self.handles.append(self.layers[idx].register_forward_pre_hook(self._on_layer(idx), with_kwargs=True))
        if hasattr(lm, "_deepstack_process"):  # Qwen3-VL: a method, not a module, so no hook: wrap it meanwhile
            lm._deepstack_process = self._deepstack(lm._deepstack_process)
            self.handles.append(_Unwrap(lm, "_deepstack_process"))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False

    def _deepstack(self, original):
        """Qwen3-VL's DeepStack addition on the current (maybe pruned) columns: ``visual_pos_masks [B, L]`` and
        ``embeds [V, d]`` (one row per image column, row-major) are cut to the kept, live image columns."""

        def process(hidden, visual_pos_masks, embeds):
            if not self.prefill:  # decoding steps carry no image columns
                return original(hidden, visual_pos_masks, embeds)
            masks = visual_pos_masks.to(self.keep.device)
            row = (masks.flatten().long().cumsum(0) - 1).view_as(masks)  # [B, L]: each image column's embeds row
            kept = masks.gather(1, self.keep) & self.alive  # [B, L_cur]: kept, live image columns
            return original(hidden, kept, embeds[row.gather(1, self.keep)[kept].to(embeds.device)])

        return process

    # ---- per forward ---------------------------------------------------------------------------------
    def _on_lm(self, module, args, kwargs):
        """Remember the 2D padding mask and whether this forward is the prefill."""
        embeds = kwargs.get("inputs_embeds")
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length() if cache is not None else 0
        if embeds.shape[0] != self.visual.shape[0]:
            raise ValueError("fastv / sparsevlm run one sequence per prompt: use num_beams=1 and "
                             "num_return_sequences=1")
        self.q_len = embeds.shape[1]
        self.prefill = past == 0
        mask2d = kwargs.get("attention_mask")
        B = embeds.shape[0]
        total = past + self.q_len
        if not isinstance(mask2d, torch.Tensor) or mask2d.dim() != 2:
            mask2d = torch.ones(B, total, dtype=torch.bool, device=embeds.device)
        self.mask2d = mask2d.bool()  # [B, past + q]
        if self.prefill:
            L = self.q_len
            cols = torch.arange(L, device=embeds.device).expand(B, L)
            self.keep, self.alive = cols, self.mask2d[:, :L].clone()  # current columns, alive (non-pad, not dead)
            vis = torch.zeros(B, L, dtype=torch.bool, device=embeds.device)
            vis[:, :self.prompt_len] = self.visual.to(embeds.device)[:, :L]
            self.vis = vis
            self.layer_cols = {}  # layer idx -> (keep [B, L_l], alive [B, L_l]) for decoding
            self.merged = [0] * B

    def _scorer(self, stage: Stage):
        def hook(attn, args, kwargs):
            if not self.prefill:
                return None
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            stage.scores = self._received(attn, hidden, kwargs["position_embeddings"], stage.queries)
            return None
        return hook

    def _received(self, attn, hidden, rope, queries):
        """Attention each current column receives from the method's queries, ``[B, L_cur]`` (float32)."""
        B, L, _ = hidden.shape
        apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        hd = attn.head_dim
        q = attn.q_proj(hidden).view(B, L, -1, hd).transpose(1, 2)  # [B, H, L, hd]
        k = attn.k_proj(hidden).view(B, L, -1, hd).transpose(1, 2)  # [B, Hkv, L, hd]
        cos, sin = rope
        q, k = apply_rope(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
        allowed = self.alive[:, None, :] & (self.keep[:, None, :] <= self.keep[:, :, None])  # [B, L, L] causal
        out = torch.zeros(B, L, device=hidden.device)
        for b in range(B):
            rows = self._query_rows(b, queries)
            logits = (q[b][:, rows].float() @ k[b].transpose(-1, -2)) * attn.scaling  # [H, R, L]
            logits = logits.masked_fill(~allowed[b, rows][None], float("-inf"))
            probs = torch.softmax(logits, dim=-1)  # [H, R, L]
            if queries == "raters":
                probs = probs[:, self._raters(b, probs, rows)]
            out[b] = probs.mean(dim=(0, 1))
        return out

    def _query_rows(self, b, queries) -> torch.Tensor:
        """Current-column rows used as queries: the last token, or the live text tokens after the image."""
        if queries == "last":
            return torch.tensor([self.keep.shape[1] - 1], device=self.keep.device)
        vis_cols = self.vis[b, self.keep[b]]
        last_vis = int(vis_cols.nonzero().max())
        after = torch.arange(self.keep.shape[1], device=self.keep.device) > last_vis
        return (after & self.alive[b] & ~vis_cols).nonzero().flatten()

    def _raters(self, b, probs, rows) -> torch.Tensor:
        """SparseVLM raters: query rows whose total attention to visual tokens is at least the mean."""
        vis_cols = self.vis[b, self.keep[b]] & self.alive[b]
        relevance = probs[:, :, vis_cols].sum(-1).mean(0)  # [R]
        return (relevance >= relevance.mean()).nonzero().flatten()

    def _on_layer(self, idx):
        stage = next((s for s in self.stages if s.layer == idx), None)

        def hook(layer, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if self.prefill:
                if stage is not None:
                    hidden = self._prune(stage, hidden)
                self.layer_cols[idx] = (self.keep, self.alive)
                kwargs = self._prefill_kwargs(kwargs, hidden)
            else:
                kwargs = self._decode_kwargs(idx, kwargs, hidden)
            if "hidden_states" in kwargs or not args:
                kwargs["hidden_states"] = hidden
                return (), kwargs
            return (hidden, *args[1:]), kwargs
        return hook

    # ---- pruning ---------------------------------------------------------------------------------------
    def _prune(self, stage: Stage, hidden: torch.Tensor) -> torch.Tensor:
        """Keep ``stage.target`` visual columns per row (+ recycling); returns the gathered hidden states."""
        B, L, D = hidden.shape
        scores = stage.scores
        vis_alive = self.vis.gather(1, self.keep) & self.alive  # [B, L]
        keep_rel, hidden = [], hidden.clone()
        for b in range(B):
            cand = vis_alive[b].nonzero().flatten()
            ranked = cand[scores[b, cand].argsort(descending=True, stable=True)]
            n_keep = min(stage.targets[b], ranked.numel())
            kept, dropped = self._recycle(stage, hidden[b], ranked, n_keep, b)
            others = (~vis_alive[b]).nonzero().flatten()
            keep_rel.append((torch.cat([others, kept]), dropped))
        width = max(k.numel() for k, _ in keep_rel)
        rel = torch.empty(B, width, dtype=torch.long, device=hidden.device)
        alive = torch.empty(B, width, dtype=torch.bool, device=hidden.device)
        for b, (k, dropped) in enumerate(keep_rel):
            extra = dropped[:width - k.numel()]  # dead fillers so all rows have the same length
            cols = torch.cat([k, extra])
            order = cols.argsort()
            rel[b] = cols[order]
            alive[b] = torch.cat([self.alive[b, k], torch.zeros_like(extra, dtype=torch.bool)])[order]
        self.keep = self.keep.gather(1, rel)
        self.alive = alive
        return hidden.gather(1, rel[..., None].expand(-1, -1, D))

    def _recycle(self, stage, hidden_b, ranked, n_keep, b):
        """``(kept, dropped)`` relative columns; recycled groups are merged into their centre's hidden state."""
        if stage.recycle <= 0 or n_keep >= ranked.numel():
            return ranked[:n_keep], ranked[n_keep:]
        deleted = ranked[n_keep:]
        pool = deleted[:math.ceil(stage.recycle * deleted.numel())]
        n_centres = min(math.ceil(stage.merge * pool.numel()), n_keep) if pool.numel() else 0
        if n_centres == 0:
            return ranked[:n_keep], deleted
        centres = pool[:n_centres]
        feats = torch.nn.functional.normalize(hidden_b[pool].float(), dim=-1)
        assign = (feats @ feats[:n_centres].T).argmax(dim=1)  # [|pool|] -> centre
        assign[:n_centres] = torch.arange(n_centres, device=assign.device)
        for c in range(n_centres):
            hidden_b[centres[c]] = hidden_b[pool[assign == c]].mean(dim=0)
        self.merged[b] += n_centres
        kept = torch.cat([ranked[:n_keep - n_centres], centres])
        dropped = torch.cat([ranked[n_keep - n_centres:n_keep], pool[n_centres:], deleted[pool.numel():]])
        return kept, dropped

    # ---- masks and rotary embeddings ------------------------------------------------------------------
    def _as_mask(self, allowed: torch.Tensor, dtype) -> torch.Tensor:
        """Boolean ``allowed [B, 1, q, kv]`` in the attention implementation's format."""
        if not self.eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    def _prefill_kwargs(self, kwargs, hidden):
        allowed = self.alive[:, None, :] & (self.keep[:, None, :] <= self.keep[:, :, None])  # [B, q, kv]
        kwargs["attention_mask"] = self._as_mask(allowed[:, None], hidden.dtype)
        cos, sin = kwargs["position_embeddings"]  # [B or 1, L, hd] for the full prompt
        idx = self.keep[..., None].expand(-1, -1, cos.shape[-1])
        kwargs["position_embeddings"] = (cos.expand(self.keep.shape[0], -1, -1).gather(1, idx),
                                         sin.expand(self.keep.shape[0], -1, -1).gather(1, idx))
        pos = kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.shape[-1] == self.q_len:
            kwargs["position_ids"] = pos.expand(self.keep.shape[0], -1).gather(1, self.keep)
        return kwargs

    def _decode_kwargs(self, idx, kwargs, hidden):
        keep, alive = self.layer_cols[idx]
        B, q = hidden.shape[:2]
        past_new = self.mask2d.shape[1] - self.prompt_len  # generated tokens incl. this step's
        new_cols = torch.arange(self.prompt_len, self.prompt_len + past_new, device=hidden.device)
        key_ok = torch.cat([alive, self.mask2d[:, self.prompt_len:]], dim=1)  # [B, kv]
        q_pos = new_cols[-q:]  # this step's query columns
        causal = torch.cat([torch.zeros(q, keep.shape[1], dtype=torch.bool, device=hidden.device),
                            new_cols[None, :] > q_pos[:, None]], dim=1)  # [q, kv] True = future
        allowed = key_ok[:, None, :] & ~causal[None]
        kwargs["attention_mask"] = self._as_mask(allowed[:, None], hidden.dtype)
        return kwargs

    # ---- results -------------------------------------------------------------------------------------
    def stats(self, items) -> list[dict]:
        """Per-row Generation fields after the last pruning layer."""
        out = []
        final_keep, final_alive = self.layer_cols[max(self.layer_cols)]
        for b, item in enumerate(items):
            run = self.visual[b].nonzero().flatten().to(final_keep.device)
            kept_cols = final_keep[b][final_alive[b] & self.vis[b, final_keep[b]]]
            run_pos = torch.searchsorted(run, kept_cols)
            grid_of_run = torch.full((run.numel(),), -1, dtype=torch.long, device=run.device)
            grid_of_run[item.run_pos.to(run.device)] = item.grid_index.to(run.device)
            grid = grid_of_run[run_pos]
            out.append(dict(visual_tokens=int(kept_cols.numel()),
                            saliency_count=int(kept_cols.numel()) - self.merged[b], entropy=None,
                            kept=sorted(grid[grid >= 0].tolist())))
        return out
