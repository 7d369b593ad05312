"""Qwen2.5-VL: the kept tokens keep their original (t, h, w) M-RoPE positions; decoding continues correctly."""
import torch

from promprune.models import PrunedVLM
from promprune.models.tiny import tiny_vlm


def hand_positions(row_ids, row_mask, image_token_id, grid_hw, kept):
    """M-RoPE of one row, worked by hand from Qwen2-VL's rule, for the kept merged tokens ``kept``.

    Text before the image: 0..s-1 in all three axes; merged token k of an H x W grid: (s, s + k // W, s + k % W);
    text after the image continues at s + max(H, W).
    """
    H, W = grid_hw
    ids = row_ids[row_mask.bool()].tolist()
    s = ids.index(image_token_id)
    after = len(ids) - s - len(kept) if isinstance(kept, list) else None
    pos = [[i, i, i] for i in range(s)]
    pos += [[s, s + k // W, s + k % W] for k in kept]
    nxt = s + max(H, W)
    pos += [[nxt + j] * 3 for j in range(after)]
    return torch.tensor(pos).T  # [3, real length]


def test_positions_are_gathered_full_positions(images, prompts):
    model, processor = tiny_vlm("qwen2_5_vl")
    vlm = PrunedVLM(model, processor, method="divprune", budget=7)
    prep = vlm.prepare(images, prompts)
    kw = prep.model_kwargs
    grid = vlm.inputs(images, prompts)["image_grid_thw"]
    for b in range(len(images)):
        valid = kw["attention_mask"][b].bool()
        kept = prep.stats[b]["kept"]
        expected = hand_positions(kw["input_ids"][b], kw["attention_mask"][b], model.config.image_token_id,
                                  (int(grid[b, 1]) // 2, int(grid[b, 2]) // 2), kept)
        torch.testing.assert_close(kw["position_ids"][1:, b][:, valid], expected)
        # row 0: contiguous text positions of the pruned sequence (mask construction only)
        assert kw["position_ids"][0, b][valid].tolist() == list(range(int(valid.sum())))
        # rope deltas: the first generated token sits at max position + 1
        first_new = int(valid.sum()) + int(model.model.rope_deltas[b])
        assert first_new == int(expected.max()) + 1


def test_decoding_with_cache_matches_recompute(images, prompts):
    """generate (KV cache, positions continued as last + 1) == greedy re-forwarding the whole pruned sequence."""
    model, processor = tiny_vlm("qwen2_5_vl")
    vlm = PrunedVLM(model, processor, method="promprune", budget=5)
    steps = 4
    got = vlm.generate(images, prompts, max_new_tokens=steps)
    prep = vlm.prepare(images, prompts)
    kw = dict(prep.model_kwargs)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(**kw, use_cache=False).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            nxt_pos = kw["position_ids"][..., -1:] + 1  # [4, B, 1]
            kw["input_ids"] = torch.cat([kw["input_ids"], token], dim=1)
            kw["attention_mask"] = torch.cat([kw["attention_mask"], torch.ones_like(token)], dim=1)
            kw["position_ids"] = torch.cat([kw["position_ids"], nxt_pos], dim=-1)
    manual = kw["input_ids"][:, -steps:].tolist()
    assert [g.token_ids for g in got] == manual


def test_fixed_image_tokens(images, prompts):
    model, processor = tiny_vlm("qwen2_5_vl")
    prep = PrunedVLM(model, processor, method=None, image_tokens=16).prepare(images, prompts)
    assert [s["visual_tokens"] for s in prep.stats] == [16, 16]  # both aspect ratios -> 4 x 4 merged tokens
