"""Newton-Schulz's coefficient schedules: every step's ``(a, b, c)`` and the pre-scaling each schedule is tuned for.

A schedule is a list of ``(a, b, c)``, one per step; step ``k`` maps every singular value ``s``
of the iterate to ``a s + b s^3 + c s^5`` (``newton_schulz``). ``COEFFICIENTS`` names the ones
we ship, each with its sources; ``NORMALIZATION`` the pre-scaling ``X = G / (||G||_F * safety +
eps)`` it was tuned with; ``coefficient_list`` checks a schedule of one's own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "COEFFICIENTS",
    "DEFAULT_NORMALIZATION",
    "NORMALIZATION",
    "Coefficients",
    "FlooredNormalization",
    "Normalization",
    "coefficient_list",
    "is_number",
]

Coefficients = tuple[float, float, float]


def _paper_schedule() -> list[Coefficients]:
    # Amsel et al. 2025 (arXiv 2505.16932), their released 8-step list. Every tuple
    # but the last is divided by (1.01, 1.01^3, 1.01^5): evaluating p(x / 1.01) keeps
    # the iteration stable when bf16 rounding pushes a singular value slightly above 1.
    raw = [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    ]
    safety = 1.01
    scaled = [(a / safety, b / safety**3, c / safety**5) for a, b, c in raw[:-1]]
    return scaled + [raw[-1]]


COEFFICIENTS: dict[str, list[Coefficients]] = {
    # Keller Jordan's quintic, torch.optim.Muon's default (torch/optim/_muon.py).
    # Maximises the slope at 0; converges to singular values in roughly [0.7, 1.2].
    "keller": [(3.4445, -4.7750, 2.0315)] * 5,
    # You Jiacheng's per-step tuning (modded-nanogpt, 2024).
    "you": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    # Polar Express tuned for exactly 5 steps (karpathy/nanochat, nanochat/optim.py),
    # the minimax-optimal composition of Amsel et al. 2025, arXiv 2505.16932.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        # Not used at 5 steps. Repeating the 5th tuple would settle singular values at 1.035
        # (its p(1) = 1.06); (1.875, -1.25, 0.375) has p(1) = 1 and p'(1) = 0, so extra steps
        # converge to the exact polar factor (the paper schedule's own tail).
        (1.875, -1.25, 0.375),
    ],
    "polar_express_paper": _paper_schedule(),
    # Megatron-Core's "polar_express" (NVIDIA Emerging-Optimizers 0.3.0 ``muon_utils``): the
    # paper's 8 tuples with the 1.01 safety folded in, as that library lists them (4 digits),
    # pre-scaled by ||X||_F without a further safety: its results to float32 rounding.
    "polar_express_megatron": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    # CANS, Chebyshev-type polynomials accelerating Newton-Schulz (Grishina, Smirnov, Rakhuba,
    # arXiv 2506.10935), as NVIDIA Emerging-Optimizers 0.3.0 lists them (``muon_utils``,
    # coefficient type "cans", pre-scaled by ||X||_F): 5 steps, the last repeated for more.
    "cans": [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ],
    # The schedule Emerging-Optimizers 0.3.0 names coefficient type "deepseekv4": Keller
    # Jordan's quintic 8 times, then (2, -1.5, 0.5) twice (p(1) = 1, p'(1) = 0: it settles the
    # singular values at 1); 10 steps, the last repeated for more.
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
    # Classic cubic Newton-Schulz (Higham, "Functions of Matrices", 2008, eq. 8.20):
    # converges to the exact polar factor, slowly (a gain of 1.5 per step near 0).
    "cubic": [(1.5, -0.5, 0.0)],
}


class Normalization(NamedTuple):
    """Pre-scaling ``X = G / (||G||_F * safety + eps)`` used with a schedule."""

    safety: float
    eps: float


class FlooredNormalization(NamedTuple):
    """Pre-scaling ``X = G / max(||G||_F * safety, eps)``: torch.optim.Muon's form, which ``ns_eps`` selects.

    A matrix whose scaled norm is below ``eps`` (a vanishing gradient) is divided by ``eps`` and
    stays small, where ``Normalization`` scales it up to norm about 1.
    """

    safety: float
    eps: float


NORMALIZATION: dict[str, Normalization] = {
    "keller": Normalization(1.0, 1e-7),  # torch.optim.Muon: EPS = 1e-7
    "you": Normalization(1.0, 1e-7),
    "polar_express": Normalization(1.02, 1e-6),  # nanochat's 5-step schedule
    "polar_express_paper": Normalization(1.01, 1e-7),
    "polar_express_megatron": Normalization(1.0, 1e-7),
    "cans": Normalization(1.0, 1e-7),  # Emerging-Optimizers: X / max(||X||_F, 1e-7)
    "deepseekv4": Normalization(1.0, 1e-7),
    "cubic": Normalization(1.0, 1e-7),
}
DEFAULT_NORMALIZATION = Normalization(1.0, 1e-7)


def coefficient_list(coefficients: Sequence[float] | Sequence[Sequence[float]]) -> list[Coefficients]:
    """An explicit schedule as a list of (a, b, c) float tuples: one ``(a, b, c)`` becomes a list of one.

    Raises:
        ValueError: empty, or something other than three finite numbers per step.
    """
    if isinstance(coefficients, Sequence) and len(coefficients) == 3 and all(map(is_number, coefficients)):
        coefficients = [coefficients]  # torch.optim.Muon's form: one triple, used at every step
    try:
        schedule = [tuple(float(v) for v in abc) for abc in coefficients]
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients must be a name in {sorted(COEFFICIENTS)}, a list of (a, b, c) tuples "
            f"or one (a, b, c), got {coefficients!r}"
        ) from None
    if not schedule or any(len(abc) != 3 for abc in schedule):
        raise ValueError(f"ns_coefficients must be a non-empty list of (a, b, c) tuples, got {coefficients!r}")
    if not all(math.isfinite(v) for abc in schedule for v in abc):
        raise ValueError(f"ns_coefficients must be finite numbers, got {coefficients!r}")
    return schedule


def is_number(value: object) -> bool:
    """A real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
