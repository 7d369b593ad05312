"""Three cheaper routes to PromPrune's certified entropy bracket, measured against the shipped one and closed.

The certified split (``promprune.selection.certified``) runs matrix Lanczos on rho = C / tr(C): one float64 n x n
product and seven launches per step. Three routes would cost less, and this script shows why none is taken:

- **Moments in a fixed basis.** k products give the Chebyshev moments ``tr T_j(X)`` up to j = 2k (``X`` rho scaled to
  [-1, 1]; ``tr(T_a T_b) = (tr T_{a+b} + tr T_{|a-b|}) / 2``, and with baby and giant steps far fewer products), and
  Gautschi's modified Chebyshev algorithm turns them into the same Jacobi matrix, with no orthogonalization and about
  two launches a product. Here the moments are computed from the eigenvalues themselves (exact to rounding), so what
  fails is the map from moments to the Jacobi matrix: the step at which its coefficients first leave the Lanczos
  ones by more than 1e-6 (or stop being finite) is printed.
- **A bracket from O(n^2) work.** ``tr(rho^2) = ||rho||_F^2`` alone gives the two-node Gauss-Radau rules: with the node
  at 0 the Renyi-2 entropy (a lower bound), with the node at ``||rho||_F >= lambda_max`` an upper bound. Its width
  is printed next to the width t_sal's rounding can tolerate near mu (~1e-3 at T = 64, tau = 0.02).
- **The recurrence in float32** (2026-11-29, fourth stop). Where float64 runs at 1/64 of float32's rate (A40, L40,
  RTX cards) a float32 product would cost ~60x less. But a bracket decides only if the exact entropy lies inside it
  widened by ``certified.DECISION_MARGIN`` (2e-5). On the float32 matrix ``rho`` (the spectrum in a random
  orthonormal basis), the largest amount by which the bracket leaves its exact entropy over 6, 12, 24 and 48 steps
  is printed for the float64 recurrence (the shipped one) and for a float32 one, the latter also in margins: above 1,
  a decision the exact algorithm would not make.

    python benchmarks/entropy_routes.py            # n = 96, 576, 1296
    python benchmarks/entropy_routes.py --smoke    # n = 96 only
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from promprune.selection import certified  # noqa: E402

EXPONENTS = (0.7, 1.0, 1.3, 1.6, 2.0)  # power-law spectra lambda_i ~ i^-a: normalized entropies ~0.25 to ~0.9
STEPS = 48


def spectrum(a: float, n: int) -> np.ndarray:
    lam = np.arange(1, n + 1, dtype=np.float64) ** -a
    return lam / lam.sum()


def entropy(lam: np.ndarray) -> float:
    return float(-(lam * np.log(lam)).sum() / math.log(len(lam)))


def lanczos_jacobi(lam: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The Jacobi matrix of the uniform measure on ``lam`` by the shipped matrix Lanczos (on ``diag(lam)``, whose
    Frobenius-inner-product recurrence is the same as on any matrix with these eigenvalues)."""
    state = certified.Lanczos.start(torch.from_numpy(np.diag(lam))[None]).run(steps)
    return state.alpha[0].numpy(), state.beta[0].numpy()


def chebyshev_jacobi(lam: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The same Jacobi matrix from the Chebyshev moments of ``lam`` scaled by ``||lam||_2 >= lambda_max`` to [-1, 1],
    by the modified Chebyshev algorithm (Gautschi, "Orthogonal Polynomials: Computation and Approximation", 2.1.7)."""
    s = float(np.sqrt((lam ** 2).sum()))
    x = np.clip(2 * lam / s - 1, -1, 1)
    count = 2 * steps + 1
    j = np.arange(count)
    moments = np.cos(j[:, None] * np.arccos(x)[None, :]).mean(1) * np.where(j >= 1, 2.0 ** (1 - j), 1.0)  # monic
    a, b = np.zeros(count), np.where(j == 1, 0.5, 0.25)  # monic Chebyshev recurrence: p_{k+1} = x p_k - b_k p_{k-1}
    alpha, beta = np.zeros(steps + 1), np.zeros(steps + 1)
    alpha[0], beta[0] = moments[1] / moments[0], moments[0]
    sig_prev, sig = np.zeros(count), moments.copy()
    with np.errstate(all="ignore"):
        for k in range(1, steps + 1):
            new = np.full(count, np.nan)
            ls = np.arange(k, count - k)
            new[ls] = (sig[ls + 1] - (alpha[k - 1] - a[ls]) * sig[ls] - beta[k - 1] * sig_prev[ls]
                       + b[ls] * sig[ls - 1])
            if k < steps:
                alpha[k] = a[k] + new[k + 1] / new[k] - sig[k] / sig[k - 1]
            beta[k] = new[k] / sig[k - 1]
            sig_prev, sig = sig, new
        return s * (alpha[:steps] + 1) / 2, s * np.sqrt(beta[1:steps + 1]) / 2  # back from X to rho


def first_divergence(lam: np.ndarray) -> int:
    """The first step whose Chebyshev-derived coefficients leave the Lanczos ones by > 1e-6 (relative to the largest
    coefficient) or are not finite; ``STEPS + 1`` when none does."""
    (al, bl), (ac, bc) = lanczos_jacobi(lam, STEPS), chebyshev_jacobi(lam, STEPS)
    scale = np.abs(np.concatenate([al, bl])).max()
    bad = ~np.isfinite(ac) | ~np.isfinite(bc) | (np.abs(ac - al) > 1e-6 * scale) | (np.abs(bc - bl) > 1e-6 * scale)
    return int(np.argmax(bad)) + 1 if bad.any() else STEPS + 1


def frobenius_bracket(lam: np.ndarray) -> tuple[float, float]:
    """Normalized ``(lower, upper)`` from ``tr(rho^2)`` only: Gauss-Radau with the node at 0 (the Renyi-2 entropy)
    and with the node at ``b = ||rho||_F`` (one free node; ``f = -x log x`` has f''' > 0)."""
    n, p2 = len(lam), float((lam ** 2).sum())
    m1, m2, b = 1 / n, p2 / n, math.sqrt(p2)
    x1 = (m2 - b * m1) / (m1 - b)  # the free node: weights w1 + wb = 1 match the first two moments
    w1 = (m1 - b) / (x1 - b)
    upper = n * (w1 * -x1 * math.log(x1) + (1 - w1) * -b * math.log(b))
    return -math.log(p2) / math.log(n), upper / math.log(n)


def float32_spectra(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The float32 table's spectra: power laws from flat to steep, and 8 eigenvalues in [1, 10] over a floor of
    ~1e-3 (low-rank tokens)."""
    low = np.where(np.arange(n) < 8, rng.uniform(1, 10, n), 1e-3 * rng.uniform(0.5, 1.5, n))
    return {**{f"i^-{a:g}": spectrum(a, n) for a in (1.0, 2.0, 3.0)}, "rank 8 + floor": low / low.sum()}


def float32_miss(lam: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """How far the bracket leaves the exact entropy, ``(float64, float32)`` recurrence: the largest ``max(lo - H,
    H - hi)`` over 6, 12, 24 and 48 steps (> 0: H outside the bracket by that much; < 0: inside), on ``rho =
    Q diag(lam) Q^T`` rounded to float32 (``Q`` a random orthonormal basis; the exact algorithm's matrix is float32
    too), ``H`` its entropy from its own eigenvalues in float64. Steps whose bounds were refused are left out."""
    n = len(lam)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    rho = torch.from_numpy((q * lam) @ q.T)[None].float()
    eig = np.clip(np.linalg.eigvalsh(rho[0].double().numpy()), 0, None)
    p = eig[eig > 0] / eig.sum()
    h = float(-(p * np.log(p)).sum() / math.log(n))
    states = [certified.Lanczos.start(rho.double()), certified.Lanczos.start(rho)]
    miss, done = [-math.inf, -math.inf], 0
    for steps in (6, 12, 24, 48):
        states = [state.run(steps - done) for state in states]
        done = steps
        for i, state in enumerate(states):
            lo, hi = certified.bounds(state.alpha.double().numpy(), state.beta.double().numpy(), n)
            if np.isfinite(lo[0]):
                miss[i] = max(miss[i], lo[0] - h, h - hi[0])
    return miss[0], miss[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="n = 96 only")
    args = ap.parse_args(argv)
    sizes = (96,) if args.smoke else (96, 576, 1296)
    print(f"{'n':>5} {'spectrum':>10} {'H':>6} | {'moments fail at step':>20} | {'Lanczos width, 12 steps':>23} | "
          f"{'O(n^2) bracket':>16} {'its width':>9}")
    for n in sizes:
        for a in EXPONENTS:
            lam = spectrum(a, n)
            alpha, beta = lanczos_jacobi(lam, 12)
            lo, hi = certified.bounds(alpha[None], beta[None], n)
            f_lo, f_hi = frobenius_bracket(lam)
            fail = first_divergence(lam)
            fail_cell = f"{fail}" if fail <= STEPS else f"none by {STEPS}"
            print(f"{n:>5} {'i^-' + format(a, 'g'):>10} {entropy(lam):>6.3f} | {fail_cell:>20} | "
                  f"{hi[0] - lo[0]:>23.1e} | {f'[{f_lo:.3f}, {f_hi:.3f}]':>16} {f_hi - f_lo:>9.3f}", flush=True)
    print("(moments: exact Chebyshev moments of the spectrum, the Jacobi matrix by the modified Chebyshev algorithm, "
          "compared with matrix Lanczos; widths in normalized H; t_sal's rounding boundaries lie ~1.25e-3 apart near "
          "mu at T = 64, tau = 0.02)")
    print(f"\n{'n':>5} {'spectrum':>15} | {'float64 misses H by':>19} | {'float32 misses H by':>19} {'/ margin':>9}")
    rng = np.random.default_rng(0)
    for n in sizes:
        for name, lam in float32_spectra(n, rng).items():
            wide, narrow = float32_miss(lam, rng)
            cells = [f"{v:.1e}" if math.isfinite(v) else "refused" for v in (wide, narrow)]
            print(f"{n:>5} {name:>15} | {cells[0]:>19} | {cells[1]:>19} {narrow / certified.DECISION_MARGIN:>9.2g}",
                  flush=True)
    print("(the largest max(lo - H, H - hi) over 6 / 12 / 24 / 48 steps on the float32 rho: > 0, H outside the bracket "
          "by that much; / margin: against certified.DECISION_MARGIN, above 1 a decision the exact algorithm would "
          "not make)")


if __name__ == "__main__":
    main()
