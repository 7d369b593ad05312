"""``kernels.segment_sums``: the fixed-order sums downsample and VisionZip merge with, pinned against a Python loop."""
import pytest
import torch

from promprune.selection.kernels import segment_sums


def loop_sums(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The order ``segment_sums`` promises, written out: each run summed from 0, its rows first to last, one add at a
    time in ``rows``' dtype."""
    B, _, d = rows.shape
    out = torch.zeros(B, lengths.shape[1], d, dtype=rows.dtype)
    for b in range(B):
        start = 0
        for s, n in enumerate(lengths[b].tolist()):
            acc = torch.zeros(d, dtype=rows.dtype)
            for i in range(start, start + n):
                acc = acc + rows[b, i]
            out[b, s] = acc
            start += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_run_is_summed_from_zero_first_row_to_last(dtype):
    """Rows of widely spread magnitudes (where the order changes the bits), runs of 0 to 40 rows: bit for bit the
    loop, and each image's sums the same alone as in the batch."""
    gen = torch.Generator().manual_seed(0)
    B, L, d = 4, 60, 37
    rows = torch.randn(B, L, d, generator=gen, dtype=dtype) * torch.logspace(-6, 6, L, dtype=dtype)[None, :, None]
    lengths = torch.tensor([[0, 40, 1, 19, 0], [60, 0, 0, 0, 0], [12, 12, 12, 12, 12], [1, 2, 3, 4, 50]])
    got = segment_sums(rows, lengths)
    assert torch.equal(got, loop_sums(rows, lengths))
    reversed_order = rows[0, :40].flip(0).cumsum(0)[-1]  # the same run summed last row first
    assert not torch.equal(got[0, 1], reversed_order)  # other bits: the data tells the orders apart
    for b in range(B):
        assert torch.equal(segment_sums(rows[b:b + 1], lengths[b:b + 1]), got[b:b + 1])


def test_the_order_worked_by_hand():
    """float32: 1 + 1 + 2^24 from 0 is 2^24 + 2 (exact); 2^24 + 1 + 1 rounds to 2^24 twice (ties to even)."""
    rows = torch.tensor([1.0, 1.0, 2.0 ** 24, 2.0 ** 24, 1.0, 1.0])[None, :, None]
    sums = segment_sums(rows, torch.tensor([[3, 3]]))
    assert sums.flatten().tolist() == [2.0 ** 24 + 2, 2.0 ** 24]


def test_lengths_of_another_shape_are_refused_before_torch_reads_them():
    """torch's kernel crashes the process on lengths of another batch (no check of their shape): refused here."""
    rows = torch.randn(3, 10, 4)
    for lengths in (torch.tensor([[3, 7]]), torch.tensor([3, 7]), torch.tensor([[3, 7]] * 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="expected \\[B, S\\] int64 with B = 3"):
            segment_sums(rows, lengths)
