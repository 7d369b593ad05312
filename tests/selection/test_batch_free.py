"""An image's spectral entropy has the same bits alone as in any batch, and on either route (the certified split's
eigensolve of its undecided rows, the exact route's of the whole batch), on the CPU: MKL's batched eigensolve and
products gave a row other bits by its place in the batch (``kernels.batch_free``), and where H lay within an ulp of a
rounding boundary of T_sal the kept tokens then differed. Each case places a boundary half an ulp from the entropy an
image has alone (mu solved for it), the hardest place for these invariants."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import promprune
from promprune.selection import accel
from promprune.selection.budget import split_budget
from promprune.selection.entropy import entropy_of_matrix
from promprune.selection.kernels import batch_free
from promprune.selection.registry import TokenSet

TAU = 0.02


def boundary_mu(h: float, budget: int, k: int, side: int) -> float:
    """mu putting the half-even boundary between t_sal ``k`` and ``k + 1`` (of ``budget``) half an ulp (float32) of
    ``h`` to ``side`` (+1 above, -1 below): ``round(T (1 - sigmoid((H - mu) / tau)))`` steps there."""
    s = 1 - (k + 0.5) / budget  # sigmoid's value at the boundary
    edge = (h + float(np.nextafter(np.float32(h), np.float32(side * np.inf)))) / 2
    return edge - TAU * math.log(s / (1 - s))


def selections(x: torch.Tensor, s: torch.Tensor, budget: int, mu: float) -> dict[str, promprune.Selection]:
    out = {}
    for route in ("exact", "certified"):
        with accel.entropy(route):
            out[route] = promprune.select(x, s, budget=budget, method="promprune", mu=mu, tau=TAU)
    return out


def assert_same(a: promprune.Selection, b: promprune.Selection, what: str) -> None:
    assert torch.equal(a.saliency_count, b.saliency_count), (what, a.saliency_count, b.saliency_count)
    assert torch.equal(a.indices, b.indices), what


def check_case(x: torch.Tensor, s: torch.Tensor, row: int, budget: int, k: int, side: int) -> None:
    """Both routes keep the same tokens in the batch, and ``row`` keeps in the batch what it keeps alone."""
    alone_x, alone_s = x[row:row + 1].clone(), s[row:row + 1].clone()
    h = float(TokenSet(alone_x, None).spectral_entropy[0])
    mu = boundary_mu(h, budget, k, side)
    batch, alone = selections(x, s, budget, mu), selections(alone_x, alone_s, budget, mu)
    assert_same(batch["certified"], batch["exact"], "certified vs exact")
    for route in ("exact", "certified"):
        assert_same(alone[route], _row(batch[route], row), f"{route}: alone vs in the batch")


def _row(sel: promprune.Selection, row: int) -> promprune.Selection:
    return promprune.Selection(sel.indices[row:row + 1], sel.saliency_count[row:row + 1])


def test_the_probes_route_case_keeps_the_exact_tokens():
    """Seed 9's tokens (the probe's ``repro_route.py``): the exact route's H of row 2 in the batch was 2 ulps above
    its eigensolve alone (the certified split's, of the undecided row): t_sal 24 against 25 at a boundary between."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 64, 7, generator=g)
    s = torch.rand(4, 64, generator=g)
    for side in (1, -1):
        check_case(x, s, 2, 48, 24, side)


def test_the_probes_batch_case_selects_the_same_alone():
    """``[4, 100, 7]`` tokens (the probe's ``bv.py``): row 2's covariance and eigenvalues differed in the batch;
    t_sal 32 in the batch against 33 alone, on both routes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 100, 7, generator=g)
    s = torch.rand(4, 100, generator=g)
    for side in (1, -1):
        check_case(x, s, 2, 64, 32, side)


SHAPES = [(64, 7), (100, 7), (33, 5), (100, 16), (33, 64), (64, 33), (16, 33), (48, 48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_rows_entropy_has_the_same_bits_alone_as_in_a_batch(dtype):
    g = torch.Generator().manual_seed(1)
    for n, d in SHAPES:
        for batch in (2, 3, 5):
            x = (torch.randn(batch, n, d, generator=g) + 0.5 * torch.randn(1, 1, d, generator=g)).to(dtype)
            h = promprune.spectral_entropy(x)
            alone = torch.cat([promprune.spectral_entropy(x[i:i + 1].clone()) for i in range(batch)])
            assert torch.equal(h, alone), (n, d, batch, (h - alone).abs().max())


def test_batch_free_gives_a_matrix_its_eigenvalues_alone_at_any_place_in_a_batch():
    """MKL gave a 7 x 7 float32 matrix other eigenvalues at places 2 and 6 of a batch (8 mod 16 bytes), a float64 one
    at every odd place; ``batch_free`` eigensolves each from storage of its own."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(7, 7, generator=g, dtype=dtype)
        a = a @ a.T
        want = torch.linalg.eigvalsh(a[None])[0]
        for place in range(8):
            mats = torch.stack([torch.eye(7, dtype=dtype)] * place + [a])
            assert torch.equal(batch_free(torch.linalg.eigvalsh, mats)[place], want), (dtype, place)


def random_case(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random batch (2-5 images of a shape where MKL's batched results depended on the place; float32 or float64),
    its saliency and a budget."""
    n, d = SHAPES[rng.integers(len(SHAPES))]
    batch = int(rng.integers(2, 6))
    dtype = torch.float64 if rng.random() < 0.3 else torch.float32
    x = torch.from_numpy(rng.standard_normal((batch, n, d)) + rng.uniform(0, 1) * rng.standard_normal(d)).to(dtype)
    return x, torch.from_numpy(rng.random((batch, n))).float(), int(rng.integers(8, n + 1))


def test_boundary_cases_count_the_same_alone_in_a_batch_and_in_any_subset():
    """300 random batches, a boundary of t_sal half an ulp from one image's entropy alone, above or below it: the
    exact route's H of the batch, the eigensolve of a random subset of its rows (as the certified split's of the rows
    it leaves undecided) and the image's alone give one count."""
    rng = np.random.default_rng(2026)
    for case in range(300):
        x, _, budget = random_case(rng)
        row, k, side = int(rng.integers(len(x))), int(rng.integers(1, budget - 1)), int(rng.choice([-1, 1]))
        tokens = TokenSet(x, None)
        alone = TokenSet(x[row:row + 1].clone(), None).spectral_entropy
        subset = np.sort(np.append(rng.choice(np.delete(np.arange(len(x)), row), int(rng.integers(len(x))),
                                              replace=False), row))
        some = entropy_of_matrix(tokens.spectral_matrix[torch.from_numpy(subset)])
        h = torch.stack([tokens.spectral_entropy[row], some[int(np.flatnonzero(subset == row)[0])], alone[0]])
        mu = boundary_mu(float(alone[0]), budget, k, side)
        counts = split_budget(h.double(), budget, mu=mu, tau=TAU)
        assert (counts == counts[0]).all() and torch.equal(h, h[:1].expand(3)), (case, h.tolist(), counts.tolist())


def test_boundary_cases_keep_the_same_tokens_on_both_routes_alone_and_in_a_batch():
    """Twelve of them through ``select``: the certified route keeps the exact route's tokens, and the image keeps
    alone what it keeps in the batch, on both."""
    rng = np.random.default_rng(53)
    for _ in range(12):
        x, s, budget = random_case(rng)
        check_case(x, s, int(rng.integers(len(x))), budget, int(rng.integers(1, budget - 1)), int(rng.choice([-1, 1])))


def test_an_empty_batch_has_an_empty_entropy():
    """A review's case: the batch-free path joined its rows with torch.cat, which refuses an empty list: an empty batch
    raised where it gave an empty result (as ``feature_norm_entropy`` still does)."""
    for dtype in (torch.float32, torch.float64):
        for shape in ((0, 16, 8), (0, 4, 32)):  # covariance (N > d) and Gram (N <= d)
            out = promprune.spectral_entropy(torch.randn(*shape, dtype=dtype))
            assert out.shape == (0,)
