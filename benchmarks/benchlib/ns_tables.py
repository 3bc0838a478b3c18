"""The Newton-Schulz tables of ``bench_optimizer.py``: accuracy, roofline, batching, Gram, symmetric.

- accuracy: error against the float64 SVD polar factor per coefficient schedule and dtype;
- roofline: Newton-Schulz throughput as a fraction of the same matmuls alone;
- batching: a loop of ``orthogonalize`` against ``orthogonalize_many`` and one stacked call;
- gram: standard against Gram Newton-Schulz on wide matrices, time and error;
- symmetric: the symmetric products (``S S^T``, ``A A``) dense against 2 x 2 blocks.

Each ``bench_*`` prints its table and returns its rows and targets for the JSON report.
benchmarks/README.md says what each table measures and which targets it checks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from benchlib.harness import dtype_name, progress, table, target, verdict
from benchlib.timing import Settings, measure, measure_interleaved
from lightning_muon.newton_schulz import (
    BATCH_MAX_ELEMENTS,
    COEFFICIENTS,
    CUDA_BATCH_MAX_ELEMENTS,
    GRAM_MIN_ASPECT,
    GRAM_MIN_SHORT_SIDE,
    HALF_BATCH_MAX_ELEMENTS,
    HALF_BATCH_MAX_SHORT_SIDE,
    SYMMETRIC_MIN_LONG_SIDE,
    SYMMETRIC_MIN_SHORT_SIDE,
    bf16_matmul_is_fast,
    gram_,
    ns_flops,
    orthogonalize,
    orthogonalize_many,
    resolve_ns_dtype,
    resolve_ns_method,
    square_,
    stacks,
    symmetric_blocks,
)

NS_STEPS = 5

# Targets (benchmarks/README.md).
PE_OVER_KELLER_MAX = 0.8
ROOFLINE_MIN = 0.85
ROOFLINE_FROM_DIM = 384
# On a GPU matrices below 2048 are launch-bound (a 1024 x 1024 bf16 product takes ~10 us); from
# 2048 on, Newton-Schulz should keep 70% of its bare matmuls' rate.
ROOFLINE_MIN_CUDA = 0.7
ROOFLINE_FROM_DIM_CUDA = 2048
GRAM_SPEEDUP_MIN = 1.3  # standard / gram time on m x 4m, m >= GRAM_MIN_SHORT_SIDE
GRAM_ERROR_RTOL = 1e-3
# Shapes (short side, long side) of the symmetric table: around the thresholds and beyond.
SYMMETRIC_SHAPES = (
    (256, 1024),
    (384, 384),
    (384, 768),
    (384, 1536),
    (512, 512),
    (512, 2048),
    (768, 768),
    (768, 3072),
    (1024, 1024),
    (1024, 4096),
)  # "equal error": |err gram - err standard| <= this * err standard

# Where bf16 matmul has no fast kernel (AVX2-only CPUs: ~1-20 GFLOP/s against ~150 in
# fp32), bf16 roofline entries above this many FLOPs per call are skipped.
SLOW_BF16_MAX_FLOPS = 2e9


# ---------------------------------------------------------------- accuracy


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
    runs = (("float64", G, torch.float64), (f"auto={dtype_name(auto)}", G.float(), None))
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
        target(f"accuracy: polar_express/keller error, 5 steps, {label}", v, "<=", PE_OVER_KELLER_MAX)
        for label, v in ratios.items()
    ]
    headers = ["schedule", "steps"]
    for label, _, _ in runs:
        headers += [f"err {label}", "s_min", "s_max"]
    print(f"\n== accuracy: Newton-Schulz vs float64 SVD polar factor, {rows}x{cols}, s in [1e-3, 1] ==")
    print("err = ||O - U V^T||_F / ||U V^T||_F;  s_min, s_max = extreme singular values of O")
    print(table(headers, table_rows))
    for label, v in ratios.items():
        print(f"polar_express / keller error at 5 steps ({label}): {v:.3f}  (target <= {PE_OVER_KELLER_MAX})")
    return {
        "matrix": {"rows": rows, "cols": cols, "singular_values": "logspace(0, -3)"},
        "auto_dtype": dtype_name(auto),
        "rows": results,
        "pe_over_keller_5_steps": ratios,
        "targets": targets,
    }


# ---------------------------------------------------------------- roofline


def _matmul_mix(X: Tensor, A: Tensor, B: Tensor, Y: Tensor, steps: int) -> None:
    """The matmuls of ``steps`` Newton-Schulz iterations alone: ns_flops(m, n, steps) FLOPs."""
    for _ in range(steps):
        torch.mm(X, X.mT, out=A)  # (m, m) Gram
        torch.mm(A, A, out=B)  # (m, m)
        torch.mm(B, X, out=Y)  # (m, n)


def bench_roofline(settings: Settings) -> dict[str, Any]:
    device = settings.device
    cuda = device.type == "cuda"
    shapes: list[tuple[int, int]]
    if settings.quick:
        shapes = [(d, aspect * d) for d in (32, 64) for aspect in (1, 4)]
    elif cuda:  # 8192 square only: 8192 x 32768 adds 3 GiB per fp32 buffer and nothing new
        shapes = [(d, aspect * d) for d in (256, 512, 1024, 2048, 4096) for aspect in (1, 4)] + [(8192, 8192)]
    else:
        shapes = [(d, aspect * d) for d in (64, 128, 256, 384, 512, 768, 1024) for aspect in (1, 4)]
    from_dim, bound = (ROOFLINE_FROM_DIM_CUDA, ROOFLINE_MIN_CUDA) if cuda else (ROOFLINE_FROM_DIM, ROOFLINE_MIN)
    scale, unit = (1e12, "TFLOP/s") if cuda else (1e9, "GFLOP/s")
    auto = resolve_ns_dtype(None, device, torch.float32)
    fast_bf16 = bf16_matmul_is_fast(device)
    budget = min(settings.budget_s, 1.0)
    gen = torch.Generator().manual_seed(0)
    rows, targets, table_rows = [], [], []
    # The device's bare GEMM rate in the automatic dtype: one square product of the largest short side.
    side = max(m for m, _ in shapes)
    G = torch.randn(side, side, generator=gen).to(device, auto)
    G_out = torch.empty_like(G)
    gemm = measure(lambda G=G, G_out=G_out: torch.mm(G, G, out=G_out), settings, budget)
    peak = 2 * side**3 / gemm.seconds
    del G, G_out
    progress(f"roofline: bare {dtype_name(auto)} GEMM {side}^3: {peak / scale:.1f} {unit}")
    for m, n in shapes:
        flops = ns_flops(m, n, NS_STEPS)
        X32 = (torch.randn(m, n, generator=gen) / math.sqrt(n)).to(device)  # (m, n), ||rows|| ~ 1
        row: dict[str, Any] = {"shape": [m, n], "gflop_per_call": flops / 1e9}
        for dtype in (torch.float32, torch.bfloat16):
            key = dtype_name(dtype)
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
            progress(f"roofline {m}x{n} {key}: NS/matmul {row[key]['fraction']:.2f}")
        fraction = row[dtype_name(auto)]["fraction"]
        row["ns_over_peak_gemm"] = row[dtype_name(auto)]["ns_flops_per_s"] / peak
        check = ""
        if m >= from_dim:
            name = f"roofline: NS/matmul {m}x{n} {dtype_name(auto)}"
            targets.append(target(name, fraction, ">=", bound))
            check = f">= {bound}: {verdict(targets[-1]['passed'])}"
        rows.append(row)
        cells: list[Any] = [f"{m}x{n}", flops / 1e9]
        for key in ("float32", "bfloat16"):
            if key in row:
                r = row[key]
                cells += [r["ns_flops_per_s"] / scale, r["matmul_flops_per_s"] / scale, r["fraction"]]
            else:
                cells += ["-", "-", "-"]
        table_rows.append([*cells, fraction, row["ns_over_peak_gemm"], check])
    print(f"\n== roofline: orthogonalize ({NS_STEPS} steps, polar_express) vs its bare matmuls, {unit} ==")
    print("matmul = the same torch.mm calls (X X^T, A A, B X) without the rest of the iteration; frac = NS / matmul")
    print(f"peak = one bare {dtype_name(auto)} GEMM {side} x {side} x {side}: {peak / scale:.1f} {unit}")
    if not fast_bf16:
        print(f"bf16 has no fast matmul here: bf16 columns only up to {SLOW_BF16_MAX_FLOPS / 1e9:.0f} GFLOP per call")
    headers = ["shape", "GFLOP", "fp32 NS", "fp32 mm", "frac", "bf16 NS", "bf16 mm", "frac"]
    print(table([*headers, f"frac {dtype_name(auto)}", f"NS/peak {dtype_name(auto)}", "target"], table_rows))
    peak_gemm = {"shape": [side, side, side], "dtype": dtype_name(auto), "flops_per_s": peak, "timing": gemm.as_dict()}
    result = {"unit_note": "flops_per_s", "auto_dtype": dtype_name(auto), "peak_gemm": peak_gemm, "rows": rows}
    return {**result, "targets": targets}


# ---------------------------------------------------------------- batching


def bench_batching(settings: Settings) -> dict[str, Any]:
    device = settings.device
    if settings.quick:
        shapes: tuple[tuple[int, int], ...] = ((16, 64), (64, 256), (192, 768))
    else:
        shapes = (
            (16, 64),
            (64, 64),
            (64, 256),
            (128, 512),
            (256, 256),
            (256, 1024),
            (384, 384),
            (384, 1536),
            (512, 512),
            (768, 768),
            (768, 3072),
        )
        if device.type == "cuda":  # GPT-2's shapes up to where stacks reach on a GPU (2^24 elements), and past it
            shapes = ((256, 1024), (768, 768), (768, 3072), (1024, 4096), (2048, 2048), (2048, 8192), (4096, 4096))
            shapes += ((4096, 8192),)
    count = 12
    auto = resolve_ns_dtype(None, device, torch.float32)
    budget = min(settings.budget_s, 1.5)
    gen = torch.Generator().manual_seed(0)
    rows, table_rows = [], []
    for m, n in shapes:
        mats = [torch.randn(m, n, generator=gen).to(device) for _ in range(count)]  # 12 x (m, n)
        # In turn, one call each per round: the ratios compare calls that met the same load.
        timings = measure_interleaved(
            {
                "loop": lambda mats=mats: [orthogonalize(M) for M in mats],
                "many": lambda mats=mats: orthogonalize_many(mats),
                "stacked": lambda mats=mats: orthogonalize(torch.stack(mats)),
            },
            settings,
            budget,
        )
        loop, many, stacked = timings["loop"], timings["many"], timings["stacked"]
        path = "stacked" if stacks(m, n, auto, device) else "per-matrix"
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
                "timings": {key: t.as_dict() for key, t in timings.items()},
            }
        )
        progress(f"batching {m}x{n}: loop/many {rows[-1]['loop_over_many']:.2f}")
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
    print(f"\n== batching: {count} same-shape matrices, {dtype_name(auto)}, ms per call ==")
    print(
        f"many = orthogonalize_many (stacks shapes with <= BATCH_MAX_ELEMENTS = {BATCH_MAX_ELEMENTS:,} elements;"
        f" on a GPU up to {CUDA_BATCH_MAX_ELEMENTS:,}; in bf16/fp16 on a CPU up to {HALF_BATCH_MAX_ELEMENTS:,} with a"
        f" short side <= {HALF_BATCH_MAX_SHORT_SIDE}; else the same per-matrix loop)"
    )
    print(
        "stacked = orthogonalize(torch.stack(...)) forced at every size; speed-up = loop time / other time;"
        " the three step in turn"
    )
    headers = ["shape", "elements", "many path", "loop ms", "many ms", "stacked ms", "loop/many", "loop/stacked"]
    print(table(headers, table_rows))
    return {
        "count": count,
        "dtype": dtype_name(auto),
        "batch_max_elements": BATCH_MAX_ELEMENTS,
        "half_batch_max_elements": HALF_BATCH_MAX_ELEMENTS,
        "half_batch_max_short_side": HALF_BATCH_MAX_SHORT_SIDE,
        "rows": rows,
    }


# ---------------------------------------------------------------- gram


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
            pair = measure_interleaved(
                {
                    method: lambda G=G, method=method: orthogonalize(G, NS_STEPS, "polar_express", dtype, method)
                    for method in ("standard", "gram")
                },
                settings,
                budget / 2,  # the two share the budget of one measurement
            )
            std, gram = pair["standard"], pair["gram"]
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
            progress(f"gram {m}x{n}: standard/gram {speedup:.2f}, error gap {error_gap:.1e}")
            check = ""
            if aspect == 4 and m >= GRAM_MIN_SHORT_SIDE:
                name = f"gram: standard/gram time at equal error, {m}x{n} fp32"
                value = speedup if error_gap <= GRAM_ERROR_RTOL else 0.0
                targets.append(target(name, value, ">=", GRAM_SPEEDUP_MIN))
                check = f">= {GRAM_SPEEDUP_MIN}: {verdict(targets[-1]['passed'])}"
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
    print(table(headers, table_rows))
    return {
        "dtype": dtype_name(dtype),
        "steps": NS_STEPS,
        "schedule": "polar_express",
        "gram_min_aspect": GRAM_MIN_ASPECT,
        "gram_min_short_side": GRAM_MIN_SHORT_SIDE,
        "rows": rows,
        "targets": targets,
    }


# ---------------------------------------------------------------- symmetric


def _symmetric_calls(S: Tensor, A: Tensor, out: Tensor, b: float, c: float) -> dict[str, Any]:
    return {
        "gram dense": lambda: gram_(S, A, False),
        "gram blocks": lambda: gram_(S, A, True),
        "square dense": lambda: square_(A, out, b, c, False),
        "square blocks": lambda: square_(A, out, b, c, True),
    }


def bench_symmetric(settings: Settings) -> dict[str, Any]:
    """Newton-Schulz's symmetric products, dense against 2 x 2 blocks, per shape and dtype.

    ``gram``: ``A = S S^T`` of a k x n matrix; ``square``: ``b A + c A A`` of the k x k result.
    ``picks`` is what ``symmetric_blocks`` chooses for a matrix iterated alone on this device.
    """
    device = settings.device
    shapes = ((32, 64),) if settings.quick else SYMMETRIC_SHAPES
    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_matmul_is_fast(device) else [])
    budget = min(settings.budget_s, 1.0)
    b, c = COEFFICIENTS["keller"][0][1:]
    rows, table_rows = [], []
    for dtype in dtypes:
        for k, n in shapes:
            S = torch.randn(k, n, device=device, dtype=dtype) / math.sqrt(n)  # (k, n)
            A, out = S.new_empty(k, k), S.new_empty(k, k)  # (k, k)
            gram_(S, A, False)
            times = measure_interleaved(_symmetric_calls(S, A, out, b, c), settings, budget / 4)
            ratios = {p: times[f"{p} blocks"].seconds / times[f"{p} dense"].seconds for p in ("gram", "square")}
            picks = symmetric_blocks(k, n, dtype, device)
            rows.append({"shape": [k, n], "dtype": dtype_name(dtype), "blocks_over_dense": ratios, "picks": picks})
            progress(f"symmetric {dtype_name(dtype)} {k}x{n}: gram {ratios['gram']:.3f}, square {ratios['square']:.3f}")
            table_rows.append(
                [
                    dtype_name(dtype),
                    f"{k}x{n}",
                    times["gram dense"].seconds * 1e3,
                    ratios["gram"],
                    "blocks" if picks[0] else "dense",
                    times["square dense"].seconds * 1e3,
                    ratios["square"],
                    "blocks" if picks[1] else "dense",
                ]
            )
    print("\n== symmetric: Gram and square products of Newton-Schulz, dense vs 2 x 2 blocks ==")
    print(
        "blocks/dense: time ratio (calls alternated, medians); picks: lightning_muon.newton_schulz.symmetric_blocks "
        f"(a product S S^T of k x n S in blocks where k >= {SYMMETRIC_MIN_SHORT_SIDE} and, in bf16/fp16, n >= "
        f"{SYMMETRIC_MIN_LONG_SIDE}: the Gram product is k x long, the square k x k; CPU only)"
    )
    headers = ["dtype", "shape", "gram ms", "blocks/dense", "picks", "square ms", "blocks/dense", "picks"]
    print(table(headers, table_rows))
    return {"rows": rows}
