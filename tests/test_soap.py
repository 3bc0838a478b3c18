"""SOAP and REKLS (``"soap"``, ``"rekls"`` groups) against a float64 reference written from the papers.

The reference below is a plain loop over the formulas of Vyas et al. (SOAP, arXiv 2409.11321)
and Lin et al. (KL-Shampoo, arXiv 2509.03378), with the choices NVIDIA Emerging-Optimizers
0.3.0 makes where the papers leave room: bias-corrected factor EMAs, eigh for the first
basis, the bases sorted by their eigenvalue estimates before a refresh, NAdam's look-ahead.
It multiplies matrices where the library contracts tensors, and so agrees with it to
rounding only, and only where rounding stays small:

- The first step's factors are ``G G^T`` and ``G^T G``: their eigenbases are ``G``'s singular
  vectors, the rotated gradient is diagonal, and Adam's first step divides its off-diagonal
  rounding (1e-16 of ``|G|`` in float64) by ``eps``. Gradients here are scaled to 1e-3, which
  keeps that under 1e-10 of the update. (In float32 it is 1e-7 of ``|G|``, and the first step
  of SOAP, Emerging-Optimizers' as ours, differs from exact arithmetic by its own size for
  gradients of order 1: the rounding comes out as +-1 in every off-diagonal coordinate.)
- A non-square ``G`` leaves the longer side's first factor rank-deficient, and eigh may return
  any basis of its null space. Both sides form that factor with the same product, bit for
  bit, and get the same basis; the shapes keep ``2 min(m, n) >= max(m, n)`` so that the
  second factor has full rank. KL-Shampoo's first factor is a different product on each side,
  and it inverts the factors with their null eigenvalues clamped at ``eps``, which multiplies
  the rounding of the null projector by ``1 / eps``: non-square, it is checked at 1e-5 with
  eigh every step, and at 1e-9 on square matrices.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from muon_reference import random_tensors, run_steps
from torch import nn

from lightning_muon import Muon
from lightning_muon.algorithms import HparamError, REKLSSettings, ShampooSettings, SOAPSettings, get_algorithm
from lightning_muon.newton_schulz import matmul_precision

pytestmark = [pytest.mark.numerics, pytest.mark.policy_free]  # policy_free: see conftest.py

STEPS = 10
GRAD_SCALE = 1e-3
HP = dict(lr=0.05, betas=(0.9, 0.95), shampoo_beta=0.9, weight_decay=0.1)


def soap64(
    W0: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    shampoo_beta: float,
    weight_decay: float,
    eps: float = 1e-8,
    weight_decay_method: str = "decoupled",
    nesterov: bool = False,
    correct_bias: bool = True,
    use_eigh: bool = False,
    power_iter_steps: int = 1,
    max_update_rms: float = 0.0,
    use_kl_shampoo: bool = False,
    precondition_frequency: int = 1,
    correct_shampoo_beta_bias: bool | None = None,
) -> torch.Tensor:
    """SOAP's weights after ``grads``, in float64, one formula a line."""
    W = W0.clone()
    m, n = W.shape
    b1, b2 = betas
    L, R = torch.zeros(m, m, dtype=W.dtype), torch.zeros(n, n, dtype=W.dtype)
    QL, QR = torch.eye(m, dtype=W.dtype), torch.eye(n, dtype=W.dtype)
    M, V = torch.zeros_like(W), torch.zeros_like(W)
    factor_bias = correct_bias if correct_shampoo_beta_bias is None else correct_shampoo_beta_bias
    for t, G in enumerate(grads, start=1):
        b = 1 - (1 - shampoo_beta) / (1 - shampoo_beta**t) if factor_bias else shampoo_beta
        if use_kl_shampoo:
            lam_L = torch.diag(QL.T @ L @ QL).clamp(min=eps)
            lam_R = torch.diag(QR.T @ R @ QR).clamp(min=eps)
            L, R = (
                b * L + (1 - b) / n * G @ QR @ torch.diag(1 / lam_R) @ QR.T @ G.T,
                b * R + (1 - b) / m * G.T @ QL @ torch.diag(1 / lam_L) @ QL.T @ G,
            )
        else:
            L = b * L + (1 - b) * (G @ G.T)
            R = b * R + (1 - b) * (G.T @ G)
        if (t - 1) % precondition_frequency == 0:
            M = QL @ M @ QR.T  # the first moment back in W's basis
            new = []
            for axis, (K, Q) in enumerate(((L, QL), (R, QR))):
                order = torch.argsort(torch.diag(Q.T @ K @ Q), descending=True)
                V = V.index_select(axis, order)  # the second moment follows its coordinate's rank
                Q = Q[:, order]
                if use_eigh or t == 1:
                    Q = torch.linalg.eigh(K).eigenvectors.flip(-1)
                else:
                    for _ in range(power_iter_steps):
                        Q = torch.linalg.qr(K @ Q).Q
                new.append(Q)
            QL, QR = new
            M = QL.T @ M @ QR
        A = G + weight_decay * W if weight_decay_method == "l2" else G
        Gr = QL.T @ A @ QR
        M = b1 * M + (1 - b1) * Gr
        V = b2 * V + (1 - b2) * Gr**2
        c1, c2 = (1 - b1**t, 1 - b2**t) if correct_bias else (1.0, 1.0)
        if nesterov:
            c1_next = 1 - b1 ** (t + 1) if correct_bias else 1.0
            M_hat = b1 * M / c1_next + (1 - b1) * Gr / c1
        else:
            M_hat = M / c1
        U = QL @ (M_hat / ((V / c2).sqrt() + eps)) @ QR.T
        if max_update_rms:
            U = U * min(1.0, max_update_rms / (U.pow(2).mean().sqrt().item() + 1e-7))
        shrink = {"decoupled": lr * weight_decay, "independent": weight_decay, "palm": lr * lr * weight_decay}
        W = W - shrink.get(weight_decay_method, 0.0) * W - lr * U
    return W


def _data(shape, seed=0, dtype=torch.float64):
    """Weights of order 1 and 10 gradients of order 1e-3 (the module docstring says why)."""
    (W0,) = random_tensors([shape], seed=seed, dtype=dtype)
    grads = [GRAD_SCALE * random_tensors([shape], seed=100 * seed + 10 + t, dtype=dtype)[0] for t in range(STEPS)]
    return W0, grads


def _run(algorithm: str, W0, grads, **group) -> tuple[nn.Parameter, Muon]:
    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "algorithm": algorithm, **group}])
    run_steps(opt, [p], [[g] for g in grads])
    return p, opt


def _moved_error(W, W_ref, W0) -> float:
    """The largest difference, relative to the largest distance the reference moved a weight."""
    return ((W.detach() - W_ref).abs().max() / (W_ref - W0).abs().max()).item()


GRID = list(itertools.product([False, True], [1, 3], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize(("kl", "frequency", "use_eigh", "nesterov", "correct_bias"), GRID)
def test_square_matches_float64_reference(kl, frequency, use_eigh, nesterov, correct_bias):
    """10 steps on a 12x12 matrix: SOAP and KL-Shampoo, both refreshes, every 1 and 3 steps, Nesterov, bias."""
    W0, grads = _data((12, 12), seed=1)
    options = dict(use_kl_shampoo=kl, precondition_frequency=frequency, use_eigh=use_eigh)
    options.update(nesterov=nesterov, correct_bias=correct_bias)
    p, _ = _run("soap", W0, grads, **HP, **options)
    W_ref = soap64(W0, grads, **HP, **options)
    assert (W_ref - W0).abs().max() > 0.1  # the weights did move
    assert _moved_error(p, W_ref, W0) < 1e-9


@pytest.mark.parametrize(
    "options",
    [
        dict(power_iter_steps=3),
        dict(max_update_rms=0.2),
        dict(weight_decay_method="l2", weight_decay=0.003),  # wd W of the order of the gradients
        dict(weight_decay_method="independent"),
        dict(weight_decay_method="palm"),
        dict(correct_shampoo_beta_bias=False, nesterov=True),
        dict(use_kl_shampoo=True, max_update_rms=0.2, nesterov=True, precondition_frequency=4),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_other_options_match_float64_reference(options):
    W0, grads = _data((10, 10), seed=2)
    options = {**HP, **options}
    p, _ = _run("soap", W0, grads, **options)
    assert _moved_error(p, soap64(W0, grads, **options), W0) < 1e-9


@pytest.mark.parametrize("shape", [(16, 10), (10, 16)])
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(precondition_frequency=3, correct_bias=False),
        dict(use_eigh=True, nesterov=True),
        dict(power_iter_steps=2, precondition_frequency=2),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults",
)
def test_non_square_matches_float64_reference(shape, options):
    """A rank-deficient first factor, its null basis the same on both sides (see the module docstring)."""
    W0, grads = _data(shape, seed=3)
    p, _ = _run("soap", W0, grads, **HP, **options)
    assert _moved_error(p, soap64(W0, grads, **HP, **options), W0) < 1e-9


@pytest.mark.parametrize("shape", [(16, 10), (10, 16)])
def test_non_square_kl_shampoo_matches_float64_reference(shape):
    """KL-Shampoo inverts a rank-deficient factor with its null eigenvalues clamped at eps: 1e-5 (docstring)."""
    W0, grads = _data(shape, seed=3)
    options = dict(use_kl_shampoo=True, use_eigh=True, nesterov=True)
    p, _ = _run("soap", W0, grads, **HP, **options)
    assert _moved_error(p, soap64(W0, grads, **HP, **options), W0) < 1e-5


def test_eigh_refresh_diagonalizes_the_factors():
    """After an eigh refresh, Q^T L Q and Q^T R Q are diagonal, their diagonals descending, the bases orthogonal."""
    W0, grads = _data((9, 7), seed=5)
    _, opt = _run("soap", W0, grads[:4], use_eigh=True)
    state = next(iter(opt.state.values()))
    for factor, basis in (("L", "Q_L"), ("R", "Q_R")):
        Q = state[basis]
        D = Q.T @ state[factor] @ Q
        assert (D - torch.diag(torch.diag(D))).abs().max() < 1e-12 * D.abs().max()
        assert torch.all(torch.diag(D)[:-1] >= torch.diag(D)[1:])
        assert torch.allclose(Q.T @ Q, torch.eye(Q.shape[0], dtype=Q.dtype), atol=1e-12)


def test_bf16_parameters_step_on_float32_state():
    W0, grads = _data((8, 6), seed=6, dtype=torch.float32)
    p, opt = _run("soap", W0.bfloat16(), [g.bfloat16() for g in grads])
    state = opt.state[p]
    assert p.dtype == torch.bfloat16 and {state[k].dtype for k in ("L", "R", "Q_L", "exp_avg")} == {torch.float32}
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), W0.bfloat16())


# ------------------------------------------------------------------ rekls


def test_rekls_is_soap_with_eigh_and_kl_shampoo():
    W0, grads = _data((11, 8), seed=6)
    hp = dict(lr=0.02, betas=(0.8, 0.9), shampoo_beta=0.7, eps=1e-7, weight_decay=0.05, weight_decay_method="l2")
    rekls, _ = _run("rekls", W0, grads, **hp)
    soap, _ = _run("soap", W0, grads, **hp, use_eigh=True, use_kl_shampoo=True)
    assert torch.equal(rekls, soap)
    # Its other settings are SOAP's defaults: a group that sets one (a SOAP setting REKLS fixes) is refused by name,
    # not ignored.
    refused = r"\['nesterov', 'use_eigh'\] are settings of other algorithms, not of 'rekls'"
    with pytest.raises(HparamError, match=refused):
        _run("rekls", W0, grads, **hp, use_eigh=False, nesterov=True)


# Emerging-Optimizers 0.3.0's constructor arguments with their defaults (lr has none there; stream_list, CUDA
# streams, is left out), then ours. They are our names too.
EO_SOAP = {
    "lr": 3e-3,
    "betas": (0.9, 0.95),
    "shampoo_beta": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "weight_decay_method": "decoupled",
    "nesterov": False,
    "correct_bias": True,
    "fp32_matmul_prec": "high",
    "use_eigh": False,
    "qr_fp32_matmul_prec": "high",
    "power_iter_steps": 1,
    "max_update_rms": 0.0,
    "use_kl_shampoo": False,
    "correct_shampoo_beta_bias": None,
    "precondition_frequency": 1,  # not Emerging-Optimizers': it refreshes every step
}
EO_REKLS = ["lr", "betas", "shampoo_beta", "eps", "weight_decay", "weight_decay_method"]


def test_settings_have_emerging_optimizers_names_and_defaults():
    assert get_algorithm("soap").settings is SOAPSettings and get_algorithm("rekls").settings is REKLSSettings
    assert SOAPSettings().asdict() == EO_SOAP
    assert set(SOAPSettings.field_names()) == set(EO_SOAP)
    # REKLS takes the settings SOAP and REKLS share, ShampooSettings': Emerging-Optimizers' REKLS arguments and
    # the family's fp32_matmul_prec (SOAP's default), the rest fixed at SOAP's (use_eigh and use_kl_shampoo set).
    assert REKLSSettings.field_names() == ShampooSettings.field_names()
    assert REKLSSettings().asdict() == {k: EO_SOAP[k] for k in [*EO_REKLS, "fp32_matmul_prec"]}
    # Emerging-Optimizers' constructor keywords load as they are.
    assert get_algorithm("soap").make_settings(EO_SOAP) == SOAPSettings()
    assert get_algorithm("rekls").make_settings({k: EO_SOAP[k] for k in EO_REKLS}) == REKLSSettings()


def test_matmul_precision_is_scoped_and_leaves_per_backend_settings_alone():
    before = torch.get_float32_matmul_precision()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # no CUDA tensor is made: only the type is read
    with matmul_precision("medium", cuda):
        assert torch.get_float32_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == before
    with matmul_precision("medium", cpu):  # a CPU's float32 matmul stays exact, whatever the host
        assert torch.get_float32_matmul_precision() == before
    # torch's per-backend API makes the legacy getter raise: the block runs under the user's setting.
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        with matmul_precision("highest", cuda):
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    assert torch.get_float32_matmul_precision() == before


# ------------------------------------------------------------------ checks


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lr", -1.0),
        ("betas", (0.9, 1.0)),
        ("shampoo_beta", 1.0),
        ("eps", 0.0),
        ("weight_decay", -0.1),
        ("weight_decay_method", "l1"),
        ("nesterov", 1),
        ("fp32_matmul_prec", "low"),
        ("qr_fp32_matmul_prec", "tf32"),
        ("power_iter_steps", 0),
        ("max_update_rms", -1.0),
        ("use_kl_shampoo", "yes"),
        ("correct_shampoo_beta_bias", 0),
        ("precondition_frequency", 2.0),
    ],
)
def test_bad_values_name_their_key(key, value):
    p = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(HparamError, match=rf"param group 0: {key}") as err:
        Muon([{"params": [p], "algorithm": "soap", key: value}])
    assert err.value.field == key
    with pytest.raises(HparamError, match=rf"^SOAPSettings\.{key} ") as err:
        SOAPSettings(**{key: value})
    assert err.value.field == key


def test_rekls_bad_values_name_their_key():
    with pytest.raises(HparamError, match=r"^REKLSSettings\.shampoo_beta must be") as err:
        REKLSSettings(shampoo_beta=-0.5)
    assert err.value.field == "shampoo_beta"
    with pytest.raises(HparamError, match=r"param group 0: weight_decay_method must be one of"):
        Muon([{"params": [nn.Parameter(torch.zeros(3, 2))], "algorithm": "rekls", "weight_decay_method": "x"}])


@pytest.mark.parametrize("algorithm", ["soap", "rekls"])
@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_non_matrices_are_refused_by_name(algorithm, shape):
    params = [("fc.weight", nn.Parameter(torch.zeros(3, 2))), ("odd", nn.Parameter(torch.zeros(shape)))]
    with pytest.raises(ValueError, match=rf"param group 0, parameter 1 \('odd'\): '{algorithm}' preconditions 2-D"):
        Muon([{"params": params, "algorithm": algorithm}])


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("algorithm", ["soap", "rekls"])
def test_checkpoint_round_trip_resumes_exactly(algorithm):
    """state_dict after 4 steps, loaded into a fresh optimizer: the next 6 steps are the uninterrupted run's."""
    W0, grads = _data((7, 5), seed=7)
    W0, grads = W0.float(), [g.float() for g in grads]
    group = {"lr": 0.01}
    if algorithm == "soap":
        group.update(use_kl_shampoo=True, precondition_frequency=3)
    whole, _ = _run(algorithm, W0, grads, **group)

    p = nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "algorithm": algorithm, **group}])
    run_steps(opt, [p], [[g] for g in grads[:4]])
    buffer = io.BytesIO()
    torch.save({"weight": p.detach().clone(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    q = nn.Parameter(saved["weight"])
    resumed = Muon([{"params": [q], "algorithm": algorithm, **group}])
    resumed.load_state_dict(saved["optimizer"])
    assert int(resumed.state[q]["step"]) == 4
    run_steps(resumed, [q], [[g] for g in grads[4:]])
    assert torch.equal(q, whole)
