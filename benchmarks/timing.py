"""Timing on one device within a budget: what the kernel and step tables of ``bench_optimizer.py`` share.

``measure`` times one call (a warm-up call, then repetitions while the budget lasts);
``measure_pair`` times two calls alternately, so that background load on a shared
machine falls on both alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from harness import sync


@dataclass(frozen=True)
class Settings:
    """What one run measures on, and how long it may spend per measurement."""

    device: torch.device
    quick: bool
    budget_s: float
    """Time for the repetitions after the warm-up call of one measurement."""
    max_reps: int
    """Most timed repetitions of one measurement."""
    step_budget_s: float
    """The step table runs its optional bf16 rows only while its own time stays under this."""


@dataclass(frozen=True)
class Timing:
    """Median seconds of one call; ``first_only`` when the warm-up call was the only sample."""

    seconds: float
    reps: int
    first_only: bool

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "reps": self.reps, "first_call_only": self.first_only}

    @property
    def reps_label(self) -> str:
        return "1*" if self.first_only else str(self.reps)


def measure(fn: Callable[[], Any], settings: Settings, budget_s: float | None = None) -> Timing:
    """One warm-up call, then as many timed calls as fit in the budget (at least one).

    A warm-up call that alone exceeds the budget is taken as the sample instead of
    repeating it: at that size (a bf16 step on an AVX2 CPU takes minutes) its first-call
    costs, such as allocating optimizer state, are a negligible part of it.
    """
    budget = settings.budget_s if budget_s is None else budget_s
    device = settings.device
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    first = time.perf_counter() - start
    if first >= budget:
        return Timing(first, 1, True)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < settings.max_reps and (not samples or spent + statistics.median(samples) <= budget):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
    return Timing(statistics.median(samples), len(samples), False)


def measure_pair(
    f: Callable[[], Any], g: Callable[[], Any], settings: Settings, budget_s: float
) -> tuple[Timing, Timing]:
    """Median times of ``f`` and ``g``, called alternately after one warm-up call each.

    Alternating exposes both to the same background load, which on a shared machine
    moves more than either's own variation.
    """
    device = settings.device

    def once(fn: Callable[[], Any]) -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    first_f, first_g = once(f), once(g)
    if first_f + first_g >= budget_s:  # as in ``measure``: the warm-up calls are the samples
        return Timing(first_f, 1, True), Timing(first_g, 1, True)
    a: list[float] = []
    b: list[float] = []
    while len(a) < settings.max_reps and (not a or sum(a) + sum(b) + a[-1] + b[-1] <= budget_s):
        a.append(once(f))
        b.append(once(g))
    return Timing(statistics.median(a), len(a), False), Timing(statistics.median(b), len(b), False)
