"""Timing on one device within a budget: what the kernel and step tables of ``bench_optimizer.py`` share.

``measure`` times one call (a warm-up call, then repetitions while the budget lasts);
``measure_interleaved`` times several calls in rounds, so that background load on a shared
machine falls on all alike.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchlib.harness import sync


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
    step_processes: int = 1
    """Fresh processes the step table measures in, one after another (their medians are reported)."""


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


def measure_interleaved(fns: dict[str, Callable[[], Any]], settings: Settings, budget_s: float) -> dict[str, Timing]:
    """Median times of every call in ``fns``, taken in rounds (each called once per round).

    One warm-up call each, then rounds while the total stays within ``budget_s`` per call.
    Interleaving exposes every call to the same background load and the same drift of the
    machine (on a shared 2-core VM the same step measured 145 ms in one minute and 190 ms in
    the next), which moves more than any call's own variation; a ratio of two medians taken
    this way compares like with like. Each round takes its own order, drawn at random (fixed
    seed): every call comes first, last and after every other call about equally often, so
    that a call which leaves the machine slow for a moment (a compiled step's OpenMP threads
    still spinning, caches full of its data) does not always fall on the same neighbour.
    (Turning a fixed order by one each round would not do that: it keeps every call's
    neighbours.)
    """
    device = settings.device

    def once(fn: Callable[[], Any]) -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    first = {key: once(fn) for key, fn in fns.items()}
    total_budget = budget_s * len(fns)
    if sum(first.values()) >= total_budget:  # as in ``measure``: the warm-up calls are the samples
        return {key: Timing(t, 1, True) for key, t in first.items()}
    samples: dict[str, list[float]] = {key: [] for key in fns}
    order = list(fns)
    shuffle = random.Random(0).shuffle
    spent = 0.0
    last_round = sum(first.values())
    while len(next(iter(samples.values()))) < settings.max_reps and spent + last_round <= total_budget:
        last_round = 0.0
        shuffle(order)
        for key in order:
            samples[key].append(once(fns[key]))
            last_round += samples[key][-1]
        spent += last_round
    return {key: Timing(statistics.median(v), len(v), False) for key, v in samples.items()}
