"""Benchmarks: Newton-Schulz accuracy, optimizer step time against torch.optim.Muon,
throughput against plain matmul, the batching threshold, and Gram Newton-Schulz.

One run prints every table from the same inputs (fixed seeds) on one machine, names
that machine first, and writes the same numbers as JSON. Ratios measured in the run
are the result; absolute times only give them scale.

Usage::

    python benchmarks/bench_optimizer.py                  # all tables, cuda if available
    python benchmarks/bench_optimizer.py --quick          # tiny sizes, 1 rep (smoke test)
    python benchmarks/bench_optimizer.py --sections step roofline --out /tmp/r.json

benchmarks/README.md says what each table measures and which targets it checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_muon.muon import Muon
from lightning_muon.newton_schulz import (
    BATCH_MAX_ELEMENTS,
    COEFFICIENTS,
    GRAM_MIN_ASPECT,
    GRAM_MIN_SHORT_SIDE,
    bf16_matmul_is_fast,
    ns_flops,
    orthogonalize,
    orthogonalize_many,
    resolve_ns_dtype,
    resolve_ns_method,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_optimizer.json"
SECTIONS = ("accuracy", "step", "roofline", "batching", "gram")
NS_STEPS = 5

# Hyperparameters shared by our Muon and the torch reference (values do not change the cost).
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.01
ADAMW_LR, ADAMW_BETAS, ADAMW_EPS = 3e-4, (0.9, 0.95), 1e-8
VOCAB = 256

# Targets (benchmarks/README.md).
PE_OVER_KELLER_MAX = 0.8
STEP_RATIO_MAX = 1.0
STEP_RATIO_SMALL_MAX = 0.35
SMALL_MODEL = (64, 12)
ROOFLINE_MIN = 0.85
ROOFLINE_FROM_DIM = 384
GRAM_SPEEDUP_MIN = 1.3  # standard / gram time on m x 4m, m >= GRAM_MIN_SHORT_SIDE
GRAM_ERROR_RTOL = 1e-3  # "equal error": |err gram - err standard| <= this * err standard

# Where bf16 matmul has no fast kernel (AVX2-only CPUs: ~1-20 GFLOP/s against ~150 in
# fp32), bf16 roofline entries above this many FLOPs per call are skipped.
SLOW_BF16_MAX_FLOPS = 2e9


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], settings: Settings, budget_s: float | None = None) -> Timing:
    """One warm-up call, then as many timed calls as fit in the budget (at least one).

    A warm-up call that alone exceeds the budget is taken as the sample instead of
    repeating it: at that size (a bf16 step on an AVX2 CPU takes minutes) its first-call
    costs, such as allocating optimizer state, are a negligible part of it.
    """
    budget = settings.budget_s if budget_s is None else budget_s
    device = settings.device
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    if first >= budget:
        return Timing(first, 1, True)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < settings.max_reps and (not samples or spent + statistics.median(samples) <= budget):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
    return Timing(statistics.median(samples), len(samples), False)


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    # Text columns align left, numbers right.
    left = [all(isinstance(row[i], str) for row in rows) for i in range(len(headers))]

    def fmt(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if lf else v.rjust(w) for v, w, lf in zip(values, widths, left)).rstrip()

    body = [fmt(r) for r in cells]
    line = fmt(headers)
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _verdict(passed: bool) -> str:
    return "ok" if passed else "MISS"


# ---------------------------------------------------------------- machine


def describe_machine(device: torch.device) -> dict[str, Any]:
    """CPU model, cores, torch build and GPU: the context every number in the run needs."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "bf16_matmul_fast": bf16_matmul_is_fast(device),
        "gpu": None,
        # Other processes on the same cores distort every time below; the load says how much.
        "load_avg_1m_at_start": _load_average(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device if device.type == "cuda" else 0)
        info["cuda"] = torch.version.cuda
    return info


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return -1.0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _machine_line(machine: dict[str, Any]) -> str:
    gpu = machine["gpu"] or "none"
    return (
        f"machine: {machine['cpu']}, {machine['cpu_cores']} cores ({machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}, CPU capability {machine['cpu_capability']}, GPU {gpu}; "
        f"device {machine['device']}, fast bf16 matmul: {'yes' if machine['bf16_matmul_fast'] else 'no'}; "
        f"load average {machine['load_avg_1m_at_start']:.2f}"
    )


# ---------------------------------------------------------------- 1. accuracy


def _conditioned_matrix(rows: int, cols: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``G = U diag(s) V^T`` with s logspaced from 1 to 1e-3, and its float64 SVD polar factor."""
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64, generator=gen))  # (rows, rows)
    V, _ = torch.linalg.qr(torch.randn(cols, rows, dtype=torch.float64, generator=gen))  # (cols, rows)
    s = torch.logspace(0, -3, rows, dtype=torch.float64)
    G = (U * s) @ V.T  # (rows, cols)
    P, _, Qh = torch.linalg.svd(G, full_matrices=False)
    return G, P @ Qh


def bench_accuracy(settings: Settings) -> dict[str, Any]:
    rows, cols = (64, 256) if settings.quick else (512, 2048)
    G, polar = _conditioned_matrix(rows, cols)
    G, polar = G.to(settings.device), polar.to(settings.device)
    auto = resolve_ns_dtype(None, settings.device, torch.float32)
    runs = (("float64", G, torch.float64), (f"auto={_dtype_name(auto)}", G.float(), None))
    results = []
    for name in COEFFICIENTS:
        for steps in (5, 10):
            for label, inp, dtype in runs:
                out = orthogonalize(inp, steps, name, dtype).double()  # (rows, cols)
                err = float(torch.linalg.matrix_norm(out - polar) / torch.linalg.matrix_norm(polar))
                sv = torch.linalg.svdvals(out)
                results.append(
                    {
                        "schedule": name,
                        "steps": steps,
                        "dtype": label,
                        "rel_error": err,
                        "sigma_min": float(sv.min()),
                        "sigma_max": float(sv.max()),
                    }
                )
    by_key = {(r["schedule"], r["steps"], r["dtype"]): r for r in results}
    table_rows = []
    for name in COEFFICIENTS:
        for steps in (5, 10):
            row: list[Any] = [name, steps]
            for label, _, _ in runs:
                r = by_key[(name, steps, label)]
                row += [r["rel_error"], r["sigma_min"], r["sigma_max"]]
            table_rows.append(row)
    ratios = {
        label: by_key[("polar_express", 5, label)]["rel_error"] / by_key[("keller", 5, label)]["rel_error"]
        for label, _, _ in runs
    }
    targets = [
        _target(f"accuracy: polar_express/keller error, 5 steps, {label}", v, "<=", PE_OVER_KELLER_MAX)
        for label, v in ratios.items()
    ]
    headers = ["schedule", "steps"]
    for label, _, _ in runs:
        headers += [f"err {label}", "s_min", "s_max"]
    print(f"\n== accuracy: Newton-Schulz vs float64 SVD polar factor, {rows}x{cols}, s in [1e-3, 1] ==")
    print("err = ||O - U V^T||_F / ||U V^T||_F;  s_min, s_max = extreme singular values of O")
    print(_table(headers, table_rows))
    for label, v in ratios.items():
        print(f"polar_express / keller error at 5 steps ({label}): {v:.3f}  (target <= {PE_OVER_KELLER_MAX})")
    return {
        "matrix": {"rows": rows, "cols": cols, "singular_values": "logspace(0, -3)"},
        "auto_dtype": _dtype_name(auto),
        "rows": results,
        "pe_over_keller_5_steps": ratios,
        "targets": targets,
    }


def _target(name: str, value: float, op: str, bound: float) -> dict[str, Any]:
    passed = value <= bound if op == "<=" else value >= bound
    return {"name": name, "value": value, "op": op, "bound": bound, "passed": bool(passed)}


# ---------------------------------------------------------------- 2. optimizer step


def gpt_parameters(d: int, layers: int, device: torch.device, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """A GPT-like parameter set with fixed random grads: (hidden matrices, everything else).

    Embedding and head (VOCAB x d) and LayerNorm weights/biases are "everything else";
    per layer qkv (3d, d), attention projection (d, d), fc1 (4d, d), fc2 (d, 4d) are hidden.
    """
    gen = torch.Generator().manual_seed(seed)

    def make(*shape: int) -> Tensor:
        p = (0.02 * torch.randn(shape, generator=gen)).to(device).requires_grad_()
        p.grad = torch.randn(shape, generator=gen).to(device)
        return p

    hidden: list[Tensor] = []
    other = [make(VOCAB, d)]
    for _ in range(layers):
        other += [make(d), make(d)]
        hidden += [make(3 * d, d), make(d, d)]
        other += [make(d), make(d)]
        hidden += [make(4 * d, d), make(d, 4 * d)]
    other += [make(d), make(d), make(VOCAB, d)]
    return hidden, other


def _torch_reference_step(hidden: list[Tensor], other: list[Tensor]) -> Callable[[], None]:
    muon = torch.optim.Muon(
        hidden, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True, adjust_lr_fn="original"
    )
    adamw = torch.optim.AdamW(other, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0, foreach=True)

    def step() -> None:
        muon.step()
        adamw.step()

    return step


def _heavyball_reference_step(hidden: list[Tensor], other: list[Tensor]) -> Callable[[], None] | None:
    """heavyball.Muon (compile-first: its step is torch.compile'd) on the hidden matrices, the same AdamW.

    heavyball runs its own Newton-Schulz (coefficients, dtype and lr scaling are its defaults),
    so this row compares speed only. None where heavyball is not installed
    (``pip install lightning_muon[bench]``).
    """
    try:
        import heavyball
    except ImportError:
        return None
    muon = heavyball.Muon(hidden, lr=LR, betas=(MOMENTUM, 0.99), weight_decay=WEIGHT_DECAY, nesterov=True)
    adamw = torch.optim.AdamW(other, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0, foreach=True)
    grads = [(p, p.grad) for p in hidden]  # heavyball sets .grad to None after its step

    def step() -> None:
        for p, g in grads:
            p.grad = g
        muon.step()
        adamw.step()

    step()  # compiles on the first call (seconds): outside the timed calls
    return step


def _our_step(hidden: list[Tensor], other: list[Tensor], coefficients: str, ns_dtype: str | None) -> Callable:
    groups = [
        {"params": hidden, "algorithm": "muon", "ns_coefficients": coefficients, "ns_dtype": ns_dtype},
        {"params": other, "algorithm": "adamw"},
    ]
    opt = Muon(
        groups,
        lr=LR,
        momentum=MOMENTUM,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
        adjust_lr="original",
        adamw_lr=ADAMW_LR,
        adamw_betas=ADAMW_BETAS,
        adamw_eps=ADAMW_EPS,
        adamw_weight_decay=0.0,
    )
    return opt.step


def bench_step(settings: Settings) -> dict[str, Any]:
    device = settings.device
    models = ((32, 2),) if settings.quick else ((64, 12), (384, 6), (768, 2))
    auto = _dtype_name(resolve_ns_dtype(None, device, torch.float32))
    # (label, coefficients, ns_dtype, dtype shown); None coefficients is the torch reference.
    variants = {
        "torch": ("torch.optim.Muon + AdamW", None, None, "bfloat16 (always)"),
        "heavyball": ("heavyball.Muon + AdamW", None, None, "its default"),
        "keller": ("ours, keller", "keller", None, auto),
        "polar_express": ("ours, polar_express", "polar_express", None, auto),
        "keller_bf16": ("ours, keller, bf16", "keller", "bfloat16", "bfloat16 (forced)"),
    }
    start = time.perf_counter()
    timings: dict[tuple[tuple[int, int], str], Timing] = {}

    def run(model: tuple[int, int], key: str) -> None:
        hidden, other = gpt_parameters(*model, device)
        _, coefficients, ns_dtype, _ = variants[key]
        if key == "torch":
            step = _torch_reference_step(hidden, other)
        elif key == "heavyball":
            step = _heavyball_reference_step(hidden, other)
            if step is None:
                _progress("heavyball is not installed: its rows are skipped")
                return
        else:
            step = _our_step(hidden, other, coefficients, ns_dtype)
        timings[(model, key)] = t = measure(step, settings)
        _progress(f"step d={model[0]} x {model[1]}: {variants[key][0]}: {t.seconds * 1e3:.1f} ms x {t.reps_label}")

    for model in models:
        for key in ("torch", "heavyball", "keller", "polar_express"):
            run(model, key)
    # The forced-bf16 rows repeat the reference's slow work on CPUs without fast bf16:
    # run them, smallest model first, while the predicted cost fits in the step budget.
    skipped = {}
    for model in models:
        ref = timings[(model, "torch")].seconds
        predicted = ref if ref >= settings.budget_s else ref + settings.budget_s
        remaining = settings.step_budget_s - (time.perf_counter() - start)
        if predicted <= remaining:
            run(model, "keller_bf16")
        else:
            skipped[model] = predicted
            _progress(f"step d={model[0]} x {model[1]}: bf16 row skipped (~{predicted:.0f} s, {remaining:.0f} s left)")

    rows, targets, table_rows = [], [], []
    for model in models:
        hidden, other = gpt_parameters(*model, torch.device("cpu"))
        gflop = sum(ns_flops(*p.shape, NS_STEPS) for p in hidden) / 1e9
        n_params = sum(p.numel() for p in hidden + other)
        ref = timings[(model, "torch")]
        for key, (label, _, _, dtype_label) in variants.items():
            name = f"d={model[0]} x {model[1]}"
            if (model, key) not in timings:
                table_rows.append([name, label, dtype_label, "skipped", "-", "-", "-", "-"])
                skip = {"model": list(model), "optimizer": label, "ns_dtype": dtype_label}
                why = {"skipped_predicted_s": skipped[model]} if key != "heavyball" else {"skipped": "not installed"}
                rows.append({**skip, **why})
                continue
            t = timings[(model, key)]
            ratio = t.seconds / ref.seconds
            heavy = timings.get((model, "heavyball"))
            vs_heavy = t.seconds / heavy.seconds if heavy is not None and key != "torch" else None
            check = ""
            if key in ("keller", "polar_express"):
                bound = STEP_RATIO_SMALL_MAX if model == SMALL_MODEL else STEP_RATIO_MAX
                targets.append(_target(f"step: {label} / torch, d={model[0]} x {model[1]}", ratio, "<=", bound))
                check = f"<= {bound}: {_verdict(targets[-1]['passed'])}"
            table_rows.append(
                [
                    name,
                    label,
                    dtype_label,
                    t.seconds * 1e3,
                    t.reps_label,
                    "1 (ref)" if key == "torch" else ratio,
                    "1 (ref)" if key == "heavyball" else (vs_heavy if vs_heavy is not None else "-"),
                    check,
                ]
            )
            rows.append(
                {
                    "model": list(model),
                    "params": n_params,
                    "hidden_matrices": len(hidden),
                    "ns_gflop_per_step": gflop,
                    "optimizer": label,
                    "ns_dtype": dtype_label,
                    "ms_per_step": t.seconds * 1e3,
                    "timing": t.as_dict(),
                    "ratio_vs_torch": ratio,
                    **({} if vs_heavy is None else {"ratio_vs_heavyball": vs_heavy}),
                }
            )
    print(
        "\n== step: optimizer.step() time, ours vs torch.optim.Muon and vs heavyball.Muon (hidden),"
        " each + torch.optim.AdamW(foreach) =="
    )
    print(f"GPT-like parameters, vocab {VOCAB}; fixed random grads; median ms over reps after one warm-up step")
    print("reps 1* = one step exceeded the time budget, so the warm-up step is the sample")
    for model in models:
        r = next(r for r in rows if r["model"] == list(model) and "params" in r)
        print(
            f"  d={model[0]} x {model[1]}: {r['params'] / 1e6:.2f} M params, {r['hidden_matrices']} hidden matrices, "
            f"{r['ns_gflop_per_step']:.1f} GFLOP of Newton-Schulz per step"
        )
    print(_table(["model", "optimizer", "NS dtype", "ms/step", "reps", "x/torch", "x/heavyball", "target"], table_rows))
    return {"models": [list(m) for m in models], "auto_dtype": auto, "rows": rows, "targets": targets}


# ---------------------------------------------------------------- 3. roofline


def _matmul_mix(X: Tensor, A: Tensor, B: Tensor, Y: Tensor, steps: int) -> None:
    """The matmuls of ``steps`` Newton-Schulz iterations alone: ns_flops(m, n, steps) FLOPs."""
    for _ in range(steps):
        torch.mm(X, X.mT, out=A)  # (m, m) Gram
        torch.mm(A, A, out=B)  # (m, m)
        torch.mm(B, X, out=Y)  # (m, n)


def bench_roofline(settings: Settings) -> dict[str, Any]:
    device = settings.device
    cuda = device.type == "cuda"
    if settings.quick:
        dims: tuple[int, ...] = (32, 64)
    else:
        dims = (64, 128, 256, 384, 512, 768, 1024) + ((2048, 4096) if cuda else ())
    scale, unit = (1e12, "TFLOP/s") if cuda else (1e9, "GFLOP/s")
    auto = resolve_ns_dtype(None, device, torch.float32)
    fast_bf16 = bf16_matmul_is_fast(device)
    budget = min(settings.budget_s, 1.0)
    gen = torch.Generator().manual_seed(0)
    rows, targets, table_rows = [], [], []
    for d in dims:
        for aspect in (1, 4):
            m, n = d, aspect * d
            flops = ns_flops(m, n, NS_STEPS)
            X32 = (torch.randn(m, n, generator=gen) / math.sqrt(n)).to(device)  # (m, n), ||rows|| ~ 1
            row: dict[str, Any] = {"shape": [m, n], "gflop_per_call": flops / 1e9}
            for dtype in (torch.float32, torch.bfloat16):
                key = _dtype_name(dtype)
                if dtype == torch.bfloat16 and not fast_bf16 and flops > SLOW_BF16_MAX_FLOPS:
                    continue
                X = X32.to(dtype)
                A, B, Y = X.new_empty(m, m), X.new_empty(m, m), X.new_empty(m, n)
                ns = measure(lambda X=X, dt=dtype: orthogonalize(X, NS_STEPS, "polar_express", dt), settings, budget)
                mm = measure(lambda X=X, A=A, B=B, Y=Y: _matmul_mix(X, A, B, Y, NS_STEPS), settings, budget)
                row[key] = {
                    "ns_flops_per_s": flops / ns.seconds,
                    "matmul_flops_per_s": flops / mm.seconds,
                    "fraction": mm.seconds / ns.seconds,
                    "ns_timing": ns.as_dict(),
                    "matmul_timing": mm.as_dict(),
                }
                _progress(f"roofline {m}x{n} {key}: NS/matmul {row[key]['fraction']:.2f}")
            fraction = row[_dtype_name(auto)]["fraction"]
            check = ""
            if d >= ROOFLINE_FROM_DIM:
                name = f"roofline: NS/matmul {m}x{n} {_dtype_name(auto)}"
                targets.append(_target(name, fraction, ">=", ROOFLINE_MIN))
                check = f">= {ROOFLINE_MIN}: {_verdict(targets[-1]['passed'])}"
            rows.append(row)
            cells: list[Any] = [f"{m}x{n}", flops / 1e9]
            for key in ("float32", "bfloat16"):
                if key in row:
                    r = row[key]
                    cells += [r["ns_flops_per_s"] / scale, r["matmul_flops_per_s"] / scale, r["fraction"]]
                else:
                    cells += ["-", "-", "-"]
            table_rows.append([*cells, fraction, check])
    print(f"\n== roofline: orthogonalize ({NS_STEPS} steps, polar_express) vs its bare matmuls, {unit} ==")
    print("matmul = the same torch.mm calls (X X^T, A A, B X) without the rest of the iteration; frac = NS / matmul")
    if not fast_bf16:
        print(f"bf16 has no fast matmul here: bf16 columns only up to {SLOW_BF16_MAX_FLOPS / 1e9:.0f} GFLOP per call")
    headers = ["shape", "GFLOP", "fp32 NS", "fp32 mm", "frac", "bf16 NS", "bf16 mm", "frac"]
    print(_table([*headers, f"frac {_dtype_name(auto)}", "target"], table_rows))
    return {"unit_note": "flops_per_s", "auto_dtype": _dtype_name(auto), "rows": rows, "targets": targets}


# ---------------------------------------------------------------- 4. batching


def bench_batching(settings: Settings) -> dict[str, Any]:
    device = settings.device
    if settings.quick:
        shapes: tuple[tuple[int, int], ...] = ((16, 64), (64, 256), (192, 768))
    else:
        shapes = ((16, 64), (64, 64), (64, 256), (128, 512), (256, 256), (256, 1024), (384, 1536), (768, 3072))
    count = 12
    auto = resolve_ns_dtype(None, device, torch.float32)
    budget = min(settings.budget_s, 1.5)
    gen = torch.Generator().manual_seed(0)
    rows, table_rows = [], []
    for m, n in shapes:
        mats = [torch.randn(m, n, generator=gen).to(device) for _ in range(count)]  # 12 x (m, n)
        loop = measure(lambda mats=mats: [orthogonalize(M) for M in mats], settings, budget)
        many = measure(lambda mats=mats: orthogonalize_many(mats), settings, budget)
        stacked = measure(lambda mats=mats: orthogonalize(torch.stack(mats)), settings, budget)
        batched = m * n <= BATCH_MAX_ELEMENTS
        path = "stacked" if batched else "per-matrix"
        rows.append(
            {
                "shape": [m, n],
                "elements": m * n,
                "orthogonalize_many_path": path,
                "loop_ms": loop.seconds * 1e3,
                "many_ms": many.seconds * 1e3,
                "stacked_ms": stacked.seconds * 1e3,
                "loop_over_many": loop.seconds / many.seconds,
                "loop_over_stacked": loop.seconds / stacked.seconds,
                "timings": {"loop": loop.as_dict(), "many": many.as_dict(), "stacked": stacked.as_dict()},
            }
        )
        _progress(f"batching {m}x{n}: loop/many {rows[-1]['loop_over_many']:.2f}")
        table_rows.append(
            [
                f"{m}x{n}",
                m * n,
                path,
                loop.seconds * 1e3,
                many.seconds * 1e3,
                stacked.seconds * 1e3,
                rows[-1]["loop_over_many"],
                rows[-1]["loop_over_stacked"],
            ]
        )
    print(f"\n== batching: {count} same-shape matrices, {_dtype_name(auto)}, ms per call ==")
    print(
        f"many = orthogonalize_many (stacks shapes with <= BATCH_MAX_ELEMENTS = {BATCH_MAX_ELEMENTS:,} elements, "
        "else the same per-matrix loop);"
    )
    print("stacked = orthogonalize(torch.stack(...)) forced at every size; speed-up = loop time / other time")
    headers = ["shape", "elements", "many path", "loop ms", "many ms", "stacked ms", "loop/many", "loop/stacked"]
    print(_table(headers, table_rows))
    return {"count": count, "dtype": _dtype_name(auto), "batch_max_elements": BATCH_MAX_ELEMENTS, "rows": rows}


# ---------------------------------------------------------------- 5. gram


def measure_pair(
    f: Callable[[], Any], g: Callable[[], Any], settings: Settings, budget_s: float
) -> tuple[Timing, Timing]:
    """Median times of ``f`` and ``g``, called alternately after one warm-up call each.

    Alternating exposes both to the same background load, which on a shared machine
    moves more than either's own variation.
    """
    device = settings.device

    def once(fn: Callable[[], Any]) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
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


def bench_gram(settings: Settings) -> dict[str, Any]:
    """Standard vs Gram Newton-Schulz (5 polar_express steps, float32): time and error vs SVD."""
    device = settings.device
    dims: tuple[int, ...] = (32,) if settings.quick else (64, 128, 256, 512, 1024)
    aspects = (1, 4) if settings.quick else (1, 2, 3, 4)
    budget = min(settings.budget_s, 2.0)
    dtype = torch.float32
    rows, targets, table_rows = [], [], []
    for m in dims:
        for aspect in aspects:
            n = aspect * m
            G64, polar = _conditioned_matrix(m, n, seed=m + aspect)
            G, polar = G64.to(device, dtype), polar.to(device)
            errors = {}
            for method in ("standard", "gram"):
                out = orthogonalize(G, NS_STEPS, "polar_express", dtype, method).double()  # (m, n)
                errors[method] = float(torch.linalg.matrix_norm(out - polar) / torch.linalg.matrix_norm(polar))
            std, gram = measure_pair(
                lambda G=G: orthogonalize(G, NS_STEPS, "polar_express", dtype, "standard"),
                lambda G=G: orthogonalize(G, NS_STEPS, "polar_express", dtype, "gram"),
                settings,
                budget,
            )
            speedup = std.seconds / gram.seconds
            error_gap = abs(errors["gram"] - errors["standard"]) / errors["standard"]
            auto = resolve_ns_method("auto", m, n, dtype)
            row = {
                "shape": [m, n],
                "standard_ms": std.seconds * 1e3,
                "gram_ms": gram.seconds * 1e3,
                "speedup": speedup,
                "flop_ratio": ns_flops(m, n, NS_STEPS) / ns_flops(m, n, NS_STEPS, method="gram"),
                "standard_error": errors["standard"],
                "gram_error": errors["gram"],
                "relative_error_gap": error_gap,
                "auto_picks": auto,
                "timings": {"standard": std.as_dict(), "gram": gram.as_dict()},
            }
            rows.append(row)
            _progress(f"gram {m}x{n}: standard/gram {speedup:.2f}, error gap {error_gap:.1e}")
            check = ""
            if aspect == 4 and m >= GRAM_MIN_SHORT_SIDE:
                name = f"gram: standard/gram time at equal error, {m}x{n} fp32"
                value = speedup if error_gap <= GRAM_ERROR_RTOL else 0.0
                targets.append(_target(name, value, ">=", GRAM_SPEEDUP_MIN))
                check = f">= {GRAM_SPEEDUP_MIN}: {_verdict(targets[-1]['passed'])}"
            table_rows.append(
                [
                    f"{m}x{n}",
                    std.seconds * 1e3,
                    gram.seconds * 1e3,
                    speedup,
                    row["flop_ratio"],
                    errors["standard"],
                    errors["gram"],
                    error_gap,
                    auto,
                    check,
                ]
            )
    print(f"\n== gram: standard vs Gram Newton-Schulz, {NS_STEPS} polar_express steps, float32, ms per call ==")
    print(
        "err = ||O - U V^T||_F / ||U V^T||_F (s in [1e-3, 1]); gap = |err gram - err std| / err std; "
        "speed-up = standard / gram time (calls alternated, medians)"
    )
    print(
        f"auto picks gram for long side >= {GRAM_MIN_ASPECT:g} x short side >= {GRAM_MIN_SHORT_SIDE} "
        "in float32/float64 (newton_schulz.GRAM_MIN_ASPECT, GRAM_MIN_SHORT_SIDE)"
    )
    headers = ["shape", "std ms", "gram ms", "speed-up", "FLOP ratio", "err std", "err gram", "gap", "auto", "target"]
    print(_table(headers, table_rows))
    return {
        "dtype": _dtype_name(dtype),
        "steps": NS_STEPS,
        "schedule": "polar_express",
        "gram_min_aspect": GRAM_MIN_ASPECT,
        "gram_min_short_side": GRAM_MIN_SHORT_SIDE,
        "rows": rows,
        "targets": targets,
    }


# ---------------------------------------------------------------- main

BENCHES: dict[str, Callable[[Settings], dict[str, Any]]] = {
    "accuracy": bench_accuracy,
    "step": bench_step,
    "roofline": bench_roofline,
    "batching": bench_batching,
    "gram": bench_gram,
}


def _finite_or_none(value: Any) -> Any:
    # JSON has no NaN or inf: a diverged number is written as null.
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 1 rep (a smoke test, < 20 s)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="tables to run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument(
        "--step-budget",
        type=float,
        default=None,
        help="seconds the step table may spend before skipping its optional forced-bf16 rows (default 300)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        settings = Settings(device, True, budget_s=2.0, max_reps=1, step_budget_s=60.0)
    else:
        budget = 2.0 if device.type == "cuda" else 6.0
        settings = Settings(device, False, budget_s=budget, max_reps=100, step_budget_s=300.0)
    if args.step_budget is not None:
        settings = Settings(device, settings.quick, settings.budget_s, settings.max_reps, args.step_budget)
    machine = describe_machine(device)
    print(f"lightning_muon benchmarks ({'quick' if args.quick else 'full'}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(_machine_line(machine))
    report: dict[str, Any] = {
        "machine": machine,
        "settings": {
            "quick": settings.quick,
            "budget_s": settings.budget_s,
            "max_reps": settings.max_reps,
            "step_budget_s": settings.step_budget_s,
            "sections": [s for s in SECTIONS if s in args.sections],
        },
        "sections": {},
    }
    start = time.perf_counter()
    for name in SECTIONS:
        if name not in args.sections:
            continue
        section_start = time.perf_counter()
        result = BENCHES[name](settings)
        result["elapsed_s"] = time.perf_counter() - section_start
        report["sections"][name] = result
        print(f"({name}: {result['elapsed_s']:.1f} s)")
    report["elapsed_s"] = time.perf_counter() - start
    report["load_avg_1m_at_end"] = _load_average()
    targets = [t for s in report["sections"].values() for t in s.get("targets", [])]
    report["targets_passed"] = sum(t["passed"] for t in targets)
    report["targets_total"] = len(targets)
    if targets:
        print("\n== targets ==")
        rows = [[t["name"], t["value"], f"{t['op']} {t['bound']}", _verdict(t["passed"])] for t in targets]
        print(_table(["target", "value", "bound", "result"], rows))
        print(f"{report['targets_passed']} of {len(targets)} targets met")
    print(f"\ntotal {report['elapsed_s']:.1f} s; load average at the end {report['load_avg_1m_at_end']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_finite_or_none(report), indent=1, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
