"""The downsampling control: the token grid average-pooled to exactly the budget, worked by hand."""
import pytest
import torch

import promprune
from promprune.selection.controls import pooled_cells


def grid_tokens(rows, cols):
    """Token t = (t, 10 t): easy means by hand. ``[1, rows * cols, 2]``."""
    t = torch.arange(rows * cols, dtype=torch.float32)
    return torch.stack([t, 10 * t], dim=-1)[None]


def test_square_grid_pools_blocks_and_feeds_each_block_at_its_centre():
    # 4 x 4 grid, budget 4 -> 2 x 2 cells of 2 x 2 tokens: {0,1,4,5}, {2,3,6,7}, {8,9,12,13}, {10,11,14,15}
    sel = promprune.select(grid_tokens(4, 4), budget=4, method="downsample")
    assert sel.indices.tolist() == [[0, 2, 8, 10]]  # each bin's centre token (upper-left of the middle)
    assert sel.features[0, :, 0].tolist() == [2.5, 4.5, 10.5, 12.5]
    assert sel.features[0, :, 1].tolist() == [25.0, 45.0, 105.0, 125.0]
    assert sel.saliency_count.tolist() == [0] and not sel.salient.any()


def test_budget_without_a_regular_grid_gives_rows_of_unequal_cells():
    # 4 x 4, budget 5: h = round(sqrt(5)) = 2 row bands of 2 and 3 cells
    assert pooled_cells(4, 4, 5) == [(0, 2, 0, 2), (0, 2, 2, 4), (2, 4, 0, 2), (2, 4, 1, 3), (2, 4, 2, 4)]
    sel = promprune.select(grid_tokens(4, 4), budget=5, method="downsample")
    # second band: columns [0, 2), [1, 3) (adaptive-pooling bins overlap by one), [2, 4) of rows 2-3
    assert sel.features[0, :, 0].tolist() == [2.5, 4.5, 10.5, 11.5, 12.5]
    assert sel.indices.tolist() == [[0, 2, 8, 9, 10]]


def test_grid_shape_is_given_or_the_most_square_one():
    x = grid_tokens(2, 6)  # 12 tokens: default grid 3 x 4, given grid 2 x 6
    assert pooled_cells(2, 6, 3) == [(0, 2, 0, 2), (0, 2, 2, 4), (0, 2, 4, 6)]  # one band of three 2 x 2 cells
    given = promprune.select(x, budget=3, method="downsample", grid=(2, 6))
    assert given.features[0, :, 0].tolist() == [3.5, 5.5, 7.5]
    default = promprune.select(x, budget=3, method="downsample")  # 3 x 4 -> h = round(sqrt(2.25)) = 2 bands
    assert default.indices.shape == (1, 3)
    with pytest.raises(ValueError, match="rows \\* cols = N = 12"):
        promprune.select(x, budget=3, method="downsample", grid=(5, 3))


@pytest.mark.parametrize("rows,cols", [(24, 24), (36, 36), (17, 23), (1, 9)])
@pytest.mark.parametrize("budget", [1, 7, 64, 128, 192])
def test_every_budget_is_met_exactly_with_disjoint_rows(rows, cols, budget):
    budget = min(budget, rows * cols)
    cells = pooled_cells(rows, cols, budget)
    assert len(cells) == budget
    assert all(r1 > r0 and c1 > c0 for r0, r1, c0, c1 in cells)
    sel = promprune.select(torch.randn(1, rows * cols, 3), budget=budget, method="downsample", grid=(rows, cols))
    assert len(set(sel.indices[0].tolist())) == budget


def test_regular_grid_when_the_budget_allows():
    assert len({(r0, r1) for r0, r1, _, _ in pooled_cells(24, 24, 64)}) == 8  # 8 x 8
    assert len({(r0, r1) for r0, r1, _, _ in pooled_cells(24, 24, 144)}) == 12  # 12 x 12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid, budget, d", [((12, 12), 16, 64), ((12, 12), 5, 64), ((24, 24), 64, 512)])
def test_an_image_pools_to_the_same_bits_alone_as_in_a_batch(dtype, grid, budget, d):
    """einsum's one [T, N] x [N, B d] product summed the tokens in an order that depended on B: in float64 an image's
    cells moved by an ulp (2.2e-16) between alone and in a batch. Each cell is now one segmented sum from 0 in raster
    order (``kernels.segment_sums``), the same bits whatever the batch (and the means worked by hand above still
    hold); half features are pooled in float32 and rounded once."""
    torch.manual_seed(1)
    x = torch.randn(5, grid[0] * grid[1], d).to(dtype)
    batched = promprune.select(x, budget=budget, method="downsample", grid=grid).features
    for lo, hi in ((1, 2), (0, 1), (4, 5), (1, 3), (2, 5)):
        part = promprune.select(x[lo:hi], budget=budget, method="downsample", grid=grid).features
        assert torch.equal(part, batched[lo:hi]), (lo, hi, (part - batched[lo:hi]).abs().max().item())


def test_a_cell_sums_its_weighted_tokens_from_zero_in_raster_order():
    """A 2 x 2 grid pooled to one cell: weight 1/4 (exact), products 2^24, 1, 1, -2^24 in raster order, exact mean
    2. Summed from 0 in that order in float32, 2^24 + 1 rounds back to 2^24 (ties to even) twice and the cell is 0;
    another grouping gives another value ((2^24 + 1) + (1 - 2^24) = 1), float64 the exact 2, and the same tokens
    in another raster order 2 as well (1 + 1 - 2^24 is exact). A fixed order, worked by hand: what makes a cell's
    bits its own whatever the batch."""
    x = torch.tensor([2.0 ** 26, 4.0, 4.0, -2.0 ** 26])[None, :, None]
    assert promprune.select(x, budget=1, method="downsample", grid=(2, 2)).features.item() == 0.0
    assert promprune.select(x.double(), budget=1, method="downsample", grid=(2, 2)).features.item() == 2.0
    rotated = x[:, [1, 2, 3, 0]]  # 1, 1, -2^24, 2^24
    assert promprune.select(rotated, budget=1, method="downsample", grid=(2, 2)).features.item() == 2.0


def test_a_first_call_under_inference_mode_leaves_later_calls_differentiable():
    """The pooling matrix is cached per grid, budget, device and dtype: a first call under ``torch.inference_mode``
    (as ``PrunedVLM.generate`` runs) cached inference tensors, and every later call under autograd failed ('Inference
    tensors cannot be saved for backward'). The gradient of the pooled sum is each token's count of cells / its
    cell's size: on a 4 x 4 grid pooled to 4 cells, 1/4 everywhere. Fresh shapes, so no earlier test cached them."""
    for dtype in (torch.float32, torch.float64):
        with torch.inference_mode():
            promprune.select(torch.randn(1, 16, 3, dtype=dtype), method="downsample", budget=4, grid=(4, 4))
        x = torch.randn(1, 16, 3, dtype=dtype, requires_grad=True)
        promprune.select(x, method="downsample", budget=4, grid=(4, 4)).features.sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 0.25))
