"""lr and momentum schedules: per-step tables worked out by hand, the scheduler, its state, its errors.

Every expected value below was computed by hand from the formulas in
``lightning_muon/schedules.py``'s docstring (step ``s`` is 0-based: the number of
optimizer steps already taken); none is produced by the function under test.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_muon import LRSchedule, Muon, MuonScheduler, route_parameters
from lightning_muon.schedules import MomentumWarmup, lr_multiplier, momentum_at

C6, C4 = math.cos(math.pi / 6), math.cos(math.pi / 4)  # sqrt(3)/2 and sqrt(2)/2

# (case id, LRSchedule.create arguments, expected multiplier at steps 0, 1, 2, ...)
LR_TABLES = [
    # constant, warmup 3 steps: (s + 1) / 3, then flat forever.
    ("constant-warmup", dict(falloff="constant", warmup=3), [1 / 3, 2 / 3, 1, 1, 1, 1]),
    # constant, no warmup at all.
    ("constant-plain", dict(falloff="constant"), [1, 1, 1]),
    # linear: W=2, S=1, T=7, min 0.1 -> decay over 4 steps from s=3: 1 - 0.9 * (s - 3) / 4.
    (
        "linear-stable-min",
        dict(falloff="linear", warmup=2, stable=1, total_steps=7, min_lr_ratio=0.1),
        [0.5, 1, 1, 1, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1],
    ),
    # linear: no warmup, T=4, min 0: 1 - s / 4, clamped at 0 after T.
    ("linear-plain", dict(falloff="linear", total_steps=4), [1, 0.75, 0.5, 0.25, 0, 0]),
    # cosine: warmup as a fraction 0.25 of T=8 -> W=2; decay over 6 steps: 0.5 (1 + cos(pi p)).
    (
        "cosine-fraction",
        dict(falloff="cosine", warmup=0.25, total_steps=8),
        [0.5, 1, 1, 0.5 * (1 + C6), 0.75, 0.5, 0.25, 0.5 * (1 - C6), 0, 0],
    ),
    # cosine: W=1, S=1, T=6, min 0.2 -> decay over 4 steps: 0.2 + 0.8 * 0.5 (1 + cos(pi p)).
    (
        "cosine-stable-min",
        dict(falloff="cosine", warmup=1, stable=1, total_steps=6, min_lr_ratio=0.2),
        [1, 1, 1, 0.2 + 0.4 * (1 + C4), 0.6, 0.2 + 0.4 * (1 - C4), 0.2, 0.2],
    ),
    # cosine with stable given as a fraction: W=2 (0.2 of 10), S=3 (0.3 of 10), decay over 5.
    (
        "cosine-fractions",
        dict(falloff="cosine", warmup=0.2, stable=0.3, total_steps=10),
        [0.5, 1, 1, 1, 1, 1, 0.5 * (1 + math.cos(math.pi / 5)), 0.5 * (1 + math.cos(2 * math.pi / 5))],
    ),
    # wsd: W=2, cooldown 0.25 of 12 = 3 steps -> stable 12 - 2 - 3 = 7; linear 1 - (s - 9) / 3 from s=9.
    (
        "wsd-fraction-cooldown",
        dict(falloff="wsd", warmup=2, cooldown=0.25, total_steps=12),
        [0.5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2 / 3, 1 / 3, 0, 0],
    ),
    # wsd: W = 0.1 of 20 = 2, cooldown 5 steps, min 0.1 -> stable 13; 1 - 0.9 (s - 15) / 5 from s=15.
    (
        "wsd-steps-min",
        dict(falloff="wsd", warmup=0.1, cooldown=5, total_steps=20, min_lr_ratio=0.1),
        [0.5, 1] + [1] * 13 + [1, 0.82, 0.64, 0.46, 0.28, 0.1, 0.1],
    ),
    # inverse_sqrt: W=4 -> s/4 ramp, then sqrt(4 / (s + 1)).
    (
        "inverse_sqrt-warmup",
        dict(falloff="inverse_sqrt", warmup=4),
        [0.25, 0.5, 0.75, 1, math.sqrt(4 / 5), math.sqrt(4 / 6), math.sqrt(4 / 7), math.sqrt(4 / 8)],
    ),
    # inverse_sqrt: W=2, S=2 -> stable until s=3, then sqrt((W + S) / (s + 1)).
    (
        "inverse_sqrt-stable",
        dict(falloff="inverse_sqrt", warmup=2, stable=2),
        [0.5, 1, 1, 1, math.sqrt(4 / 5), math.sqrt(4 / 6)],
    ),
    # inverse_sqrt without warmup: sqrt(1 / (s + 1)).
    ("inverse_sqrt-plain", dict(falloff="inverse_sqrt"), [1, math.sqrt(1 / 2), math.sqrt(1 / 3), 0.5]),
]

# inverse_sqrt with W=4 and min_lr_ratio 0.3: (step, raw sqrt(4 / (s + 1)) or warmup value, expected).
INVERSE_SQRT_FLOOR = [(3, 1.0, 1.0), (15, 0.5, 0.5), (35, 1 / 3, 1 / 3), (63, 0.25, 0.3), (99, 0.2, 0.3)]


@pytest.mark.parametrize(("kwargs", "expected"), [c[1:] for c in LR_TABLES], ids=[c[0] for c in LR_TABLES])
def test_lr_multiplier_table(kwargs, expected):
    schedule = LRSchedule.create(**kwargs)
    got = [lr_multiplier(s, schedule) for s in range(len(expected))]
    torch.testing.assert_close(got, [float(e) for e in expected], rtol=0, atol=1e-12)


def test_inverse_sqrt_is_floored_at_min_lr_ratio():
    schedule = LRSchedule.create("inverse_sqrt", warmup=4, min_lr_ratio=0.3)
    for step, _raw, expected in INVERSE_SQRT_FLOOR:
        assert lr_multiplier(step, schedule) == pytest.approx(expected, abs=1e-12), step


def test_create_resolves_phases_to_steps():
    wsd = LRSchedule.create("wsd", warmup=0.05, cooldown=0.3, total_steps=600)
    # wsd is stored as a linear falloff after a stable phase that ends at the cooldown.
    assert wsd == LRSchedule(falloff="linear", warmup_steps=30, stable_steps=390, total_steps=600, min_lr_ratio=0.0)
    cos = LRSchedule.create("cosine", warmup=0.1, stable=5, total_steps=50, min_lr_ratio=0.1)
    assert (cos.warmup_steps, cos.stable_steps, cos.total_steps, cos.min_lr_ratio) == (5, 5, 50, 0.1)


# momentum 0.85 -> 0.95 over 4 steps: 0.85 + 0.1 * s / 4, then the target.
MOMENTUM_TABLE = [0.85, 0.875, 0.9, 0.925, 0.95, 0.95, 0.95]


def test_momentum_warmup_table():
    warmup = MomentumWarmup(start=0.85, steps=4)
    got = [momentum_at(s, 0.95, warmup) for s in range(len(MOMENTUM_TABLE))]
    torch.testing.assert_close(got, MOMENTUM_TABLE, rtol=0, atol=1e-12)
    # No warmup: the target from step 0.
    assert [momentum_at(s, 0.95, MomentumWarmup()) for s in range(3)] == [0.95, 0.95, 0.95]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Embedding -> adamw, hidden Linear -> muon, head -> adamw, biases -> adamw_no_decay.
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10))


def _optimizer(model: nn.Module, **kwargs) -> Muon:
    return Muon(route_parameters(model), lr=0.02, adamw_lr=0.003, adamw_betas=(0.9, 0.99), **kwargs)


def _step(model: nn.Module, optimizer: Muon) -> None:
    optimizer.zero_grad()
    model(torch.arange(10)).square().mean().backward()
    optimizer.step()


def test_scheduler_drives_every_group_and_keeps_the_adamw_to_muon_ratio():
    model = _model()
    optimizer = _optimizer(model)
    assert [g["name"] for g in optimizer.param_groups] == ["adamw", "muon", "adamw_no_decay"]
    base = [g["lr"] for g in optimizer.param_groups]
    kwargs, expected = LR_TABLES[4][1], LR_TABLES[4][2]  # cosine with a fractional warmup
    scheduler = MuonScheduler(optimizer, LRSchedule.create(**kwargs), MomentumWarmup(start=0.85, steps=4))
    for step, factor in enumerate(expected):
        lrs = [g["lr"] for g in optimizer.param_groups]
        torch.testing.assert_close(lrs, [b * factor for b in base], rtol=1e-12, atol=0)
        if factor > 0:
            # AdamW lr / Muon lr stays 0.003 / 0.02 at every step.
            assert lrs[0] / lrs[1] == pytest.approx(0.15, rel=1e-12)
            assert lrs[2] / lrs[1] == pytest.approx(0.15, rel=1e-12)
        # Momentum warmup moves the Muon group only; AdamW groups keep beta1 as their read-out.
        momenta = [g["momentum"] for g in optimizer.param_groups]
        assert momenta[1] == pytest.approx(MOMENTUM_TABLE[min(step, 6)], abs=1e-12)
        assert momenta[0] == momenta[2] == 0.9
        assert [g["betas"] for g in (optimizer.param_groups[0], optimizer.param_groups[2])] == [(0.9, 0.99)] * 2
        _step(model, optimizer)
        scheduler.step()
    assert scheduler.last_epoch == len(expected)


def test_momentum_warmup_uses_each_muon_groups_own_target():
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    fast = {"params": [a.weight], "algorithm": "muon", "name": "fast", "momentum": 0.99}
    slow = {"params": [b.weight, c.weight], "algorithm": "muon", "name": "slow", "momentum": 0.9}
    vectors = {"params": [a.bias, b.bias, c.bias], "algorithm": "adamw", "name": "vectors"}
    optimizer = Muon([fast, slow, vectors])
    scheduler = MuonScheduler(optimizer, LRSchedule.create(), MomentumWarmup(start=0.5, steps=2))
    seen = []
    for _ in range(3):
        seen.append([g["momentum"] for g in optimizer.param_groups[:2]])
        optimizer.step()
        scheduler.step()
    # 0.5 + (target - 0.5) * s / 2 for s = 0, 1, then the target.
    torch.testing.assert_close(seen, [[0.5, 0.5], [0.745, 0.7], [0.99, 0.9]], rtol=0, atol=1e-12)


def test_scheduler_state_dict_round_trip_through_weights_only_load():
    schedule = LRSchedule.create("cosine", warmup=2, total_steps=10, min_lr_ratio=0.1)
    warmup = MomentumWarmup(start=0.85, steps=6)
    model = _model()
    optimizer = _optimizer(model)
    scheduler = MuonScheduler(optimizer, schedule, warmup)
    for _ in range(3):
        _step(model, optimizer)
        scheduler.step()

    buffer = io.BytesIO()
    torch.save({"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    # A fresh pair built with the same settings takes the saved step back, with no warning
    # (another schedule would win over the saved one: see the resume tests below).
    twin = _model()
    twin.load_state_dict(model.state_dict())
    twin_optimizer = _optimizer(twin)
    twin_scheduler = MuonScheduler(twin_optimizer, schedule, warmup)
    twin_optimizer.load_state_dict(loaded["optimizer"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin_scheduler.load_state_dict(loaded["scheduler"])
    assert twin_scheduler.schedule == schedule
    assert twin_scheduler.momentum_warmup == warmup
    assert twin_scheduler.last_epoch == 3

    for _ in range(8):
        assert [g["lr"] for g in twin_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
        assert [g["momentum"] for g in twin_optimizer.param_groups] == [g["momentum"] for g in optimizer.param_groups]
        for a, b in ((model, optimizer), (twin, twin_optimizer)):
            _step(a, b)
        scheduler.step()
        twin_scheduler.step()
    # Same lr, momentum and optimizer state at every step: bitwise the same parameters.
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # Step 11 is past the cosine: every group sits at min_lr_ratio of its base.
    torch.testing.assert_close(
        [g["lr"] for g in optimizer.param_groups], [0.003 * 0.1, 0.02 * 0.1, 0.003 * 0.1], rtol=1e-12, atol=0
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(falloff="exponential"), r"falloff must be one of .*'exponential'"),
        (dict(falloff="constant", warmup=0.1), r"warmup=0\.1 is a fraction of the total steps, but total_steps"),
        (dict(falloff="constant", stable=0.5), r"stable=0\.5 is a fraction of the total steps"),
        (dict(falloff="cosine"), r"falloff='cosine' needs total_steps"),
        (dict(falloff="linear"), r"falloff='linear' needs total_steps"),
        (dict(falloff="wsd"), r"falloff='wsd' needs total_steps"),
        (
            dict(falloff="linear", warmup=5, stable=6, total_steps=10),
            r"warmup \(5\) \+ stable \(6\) steps exceed total_steps \(10\)",
        ),
        (dict(falloff="cosine", warmup=11, total_steps=10), r"warmup \(11\) \+ stable \(0\) steps exceed"),
        (
            dict(falloff="wsd", warmup=6, cooldown=5, total_steps=10),
            r"warmup \(6\) \+ cooldown \(5\) steps exceed total_steps \(10\)",
        ),
        (dict(falloff="constant", min_lr_ratio=1.5), r"min_lr_ratio must be in \[0, 1\], got 1\.5"),
        (dict(falloff="constant", min_lr_ratio=-0.1), r"min_lr_ratio must be in \[0, 1\], got -0\.1"),
        (dict(falloff="constant", min_lr_ratio="0.1"), r"min_lr_ratio must be in \[0, 1\]"),
        (dict(falloff="constant", warmup=-1), r"warmup must be a number of steps or a fraction"),
        (dict(falloff="constant", warmup=2.5), r"warmup must be a whole number of steps"),
        (dict(falloff="constant", warmup=float("nan")), r"warmup must be a number of steps"),
        (dict(falloff="constant", warmup=True), r"warmup must be a number of steps"),
        (dict(falloff="wsd", cooldown=-3, total_steps=10), r"cooldown must be a number of steps"),
        (dict(falloff="linear", total_steps=0), r"total_steps must be a positive int or None, got 0"),
        (dict(falloff="linear", total_steps=10.0), r"total_steps must be a positive int or None, got 10\.0"),
    ],
)
def test_create_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule.create(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(start=1.0), r"momentum_warmup start must be in \[0, 1\), got 1\.0"),
        (dict(start=-0.1), r"momentum_warmup start must be in \[0, 1\)"),
        (dict(steps=-1), r"momentum_warmup steps must be an int >= 0, got -1"),
        (dict(steps=2.0), r"momentum_warmup steps must be an int >= 0, got 2\.0"),
    ],
)
def test_momentum_warmup_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MomentumWarmup(**kwargs)


def _saved_after(steps: int, schedule: LRSchedule) -> dict:
    model = _model()
    optimizer = _optimizer(model)
    scheduler = MuonScheduler(optimizer, schedule)
    for _ in range(steps):
        _step(model, optimizer)
        scheduler.step()
    return {"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()}


def test_resume_with_a_longer_run_takes_the_new_horizon_and_says_so():
    """A finished 30-step cosine run resumed for 40 steps continues on the 40-step cosine, never at lr 0."""
    saved = _saved_after(30, LRSchedule.create("cosine", total_steps=30))
    assert all(g["lr"] == 0.0 for g in saved["optimizer"]["param_groups"])  # the old run ended at 0
    optimizer = _optimizer(_model())
    longer = LRSchedule.create("cosine", total_steps=40)
    scheduler = MuonScheduler(optimizer, longer)
    optimizer.load_state_dict(saved["optimizer"])
    with pytest.warns(
        UserWarning, match=r"resuming at step 30 with this run's settings.*total_steps=30.*total_steps=40"
    ):
        scheduler.load_state_dict(saved["scheduler"])
    expected = lr_multiplier(30, longer)
    assert expected > 0
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
        [0.003 * expected, 0.02 * expected, 0.003 * expected]
    )
    scheduler.step()
    assert scheduler.last_epoch == 31 and all(g["lr"] > 0 for g in optimizer.param_groups)


def test_resume_with_another_lr_applies_it_and_says_so():
    """hparams say one lr, the checkpoint another: training runs at the run's own, with a warning naming both."""
    schedule = LRSchedule.create("constant")
    saved = _saved_after(3, schedule)
    model = _model()
    optimizer = _optimizer(model)
    for group in optimizer.param_groups:
        group["lr"] *= 2.5  # this run's config: 2.5x the lrs the checkpoint was trained with
    scheduler = MuonScheduler(optimizer, schedule)
    optimizer.load_state_dict(saved["optimizer"])  # torch puts the checkpoint's lrs back ...
    with pytest.warns(
        UserWarning, match=r"base_lrs: checkpoint \[0\.003, 0\.02, 0\.003\], now \[0\.0075, 0\.05, 0\.0075\]"
    ):
        scheduler.load_state_dict(saved["scheduler"])
    # ... and the scheduler sets this run's again.
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.0075, 0.05, 0.0075])
