"""The step table of ``bench_optimizer.py``: ``Muon.step`` against torch.optim.Muon and heavyball.Muon.

A GPT-like parameter set with fixed random gradients (``gpt_parameters``); our hybrid
``Muon`` (Newton-Schulz on the hidden matrices, AdamW on the rest) against
``torch.optim.Muon`` + ``torch.optim.AdamW`` with the same hyperparameters, and against
heavyball's compiled Muon where it is installed. benchmarks/README.md says which targets
the ratios check.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchlib.harness import dtype_name, progress, table, target, verdict
from benchlib.ns_tables import NS_STEPS
from benchlib.timing import Settings, Timing, measure, measure_interleaved
from lightning_muon.muon import Muon
from lightning_muon.newton_schulz import ns_flops, resolve_ns_dtype

# Hyperparameters shared by our Muon and the torch reference (values do not change the cost).
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.95, 0.01
ADAMW_LR, ADAMW_BETAS, ADAMW_EPS = 3e-4, (0.9, 0.95), 1e-8
VOCAB = 256

# Targets (benchmarks/README.md).
STEP_RATIO_MAX = 1.0
STEP_RATIO_SMALL_MAX = 0.35
SMALL_MODEL = (64, 12)
# On a GPU torch.optim.Muon's per-matrix loop is launch-bound at GPT-2 small: batching should halve it.
STEP_RATIO_GPT2_CUDA_MAX = 0.5
GPT2_SMALL = (768, 12)


def gpt_shapes(d: int, layers: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The shapes of ``gpt_parameters``: (hidden matrices, everything else), in its order."""
    hidden: list[tuple[int, ...]] = []
    other: list[tuple[int, ...]] = [(VOCAB, d)]
    for _ in range(layers):
        other += [(d,), (d,)]
        hidden += [(3 * d, d), (d, d)]
        other += [(d,), (d,)]
        hidden += [(4 * d, d), (d, 4 * d)]
    other += [(d,), (d,), (VOCAB, d)]
    return hidden, other


def gpt_parameters(d: int, layers: int, device: torch.device, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    """A GPT-like parameter set with fixed random grads: (hidden matrices, everything else).

    Embedding and head (VOCAB x d) and LayerNorm weights/biases are "everything else";
    per layer qkv (3d, d), attention projection (d, d), fc1 (4d, d), fc2 (d, 4d) are hidden.
    On a GPU the values are drawn there (a 1.3B set drawn on the host takes seconds per copy).
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(shape: tuple[int, ...]) -> Tensor:
        p = (0.02 * torch.randn(shape, generator=gen, device=device)).requires_grad_()
        p.grad = torch.randn(shape, generator=gen, device=device)
        return p

    hidden, other = gpt_shapes(d, layers)
    return [make(s) for s in hidden], [make(s) for s in other]


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


def our_optimizer(
    hidden: list[Tensor], other: list[Tensor], coefficients: str, ns_dtype: str | None, **kwargs: Any
) -> Muon:
    """Our hybrid ``Muon`` with the reference's hyperparameters: ``hidden`` to Muon, ``other`` to AdamW."""
    groups = [
        {"params": hidden, "algorithm": "muon", "ns_coefficients": coefficients, "ns_dtype": ns_dtype},
        {"params": other, "algorithm": "adamw"},
    ]
    return Muon(
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
        **kwargs,
    )


def _our_step(hidden: list[Tensor], other: list[Tensor], coefficients: str, ns_dtype: str | None) -> Callable:
    return our_optimizer(hidden, other, coefficients, ns_dtype).step


def _variants(auto: str) -> dict[str, tuple[str, str | None, str | None, str]]:
    """Rows of the table: key -> (label, coefficients, ns_dtype, dtype shown); None coefficients: a reference."""
    return {
        "torch": ("torch.optim.Muon + AdamW", None, None, "bfloat16 (always)"),
        "heavyball": ("heavyball.Muon + AdamW", None, None, "its default"),
        "keller": ("ours, keller", "keller", None, auto),
        "polar_express": ("ours, polar_express", "polar_express", None, auto),
        "keller_bf16": ("ours, keller, bf16", "keller", "bfloat16", "bfloat16 (forced)"),
    }


def _models(settings: Settings) -> tuple[tuple[int, int], ...]:
    if settings.quick:
        return ((32, 2),)
    if settings.device.type == "cuda":  # GPT-2 small and a 1.3B model (d=2048 x 24)
        return (GPT2_SMALL, (2048, 24))
    return ((64, 12), (384, 6), (768, 2))


def _ratio_bound(model: tuple[int, int], device: torch.device) -> float:
    """The largest ours/torch step ratio the targets allow for ``model`` on ``device``."""
    if model == SMALL_MODEL:
        return STEP_RATIO_SMALL_MAX
    if model == GPT2_SMALL and device.type == "cuda":
        return STEP_RATIO_GPT2_CUDA_MAX
    return STEP_RATIO_MAX


def measure_step_rows(settings: Settings) -> list[dict[str, Any]]:
    """One process's measurement: a row per (model, variant), with its time and ratios (or why it was skipped)."""
    device = settings.device
    models = _models(settings)
    auto = dtype_name(resolve_ns_dtype(None, device, torch.float32))
    variants = _variants(auto)
    start = time.perf_counter()
    timings: dict[tuple[tuple[int, int], str], Timing] = {}

    def make_step(model: tuple[int, int], key: str) -> Callable[[], None] | None:
        hidden, other = gpt_parameters(*model, device)
        _, coefficients, ns_dtype, _ = variants[key]
        if key == "torch":
            return _torch_reference_step(hidden, other)
        if key == "heavyball":
            step = _heavyball_reference_step(hidden, other)
            if step is None:
                progress("heavyball is not installed: its rows are skipped")
            return step
        return _our_step(hidden, other, coefficients, ns_dtype)

    def report(model: tuple[int, int], key: str, t: Timing) -> None:
        timings[(model, key)] = t
        progress(f"step d={model[0]} x {model[1]}: {variants[key][0]}: {t.seconds * 1e3:.1f} ms x {t.reps_label}")

    for model in models:
        # The reference and ours step in turn, one step each per round, so that the machine's
        # drift and background load fall on all alike (see ``measure_interleaved``).
        # Where bf16 is this device's automatic dtype the forced-bf16 row costs what ours
        # does: it steps in the same rounds.
        # (On a GPU that row is the same computation as "keller": left out, as a 1.3B model's fourth copy would
        # crowd an 80 GB card.)
        forced = auto == "bfloat16" and device.type != "cuda"
        keys = ("torch", "heavyball", "keller", "polar_express") + (("keller_bf16",) if forced else ())
        steps = {key: make_step(model, key) for key in keys}
        measured = measure_interleaved({k: f for k, f in steps.items() if f is not None}, settings, settings.budget_s)
        for key, t in measured.items():
            report(model, key, t)
        del steps
    # Elsewhere the forced-bf16 rows repeat the reference's slow work (CPUs without fast
    # bf16): run them alone, smallest model first, while the predicted cost fits the budget.
    skipped = {}
    for model in models if auto != "bfloat16" else ():
        ref = timings[(model, "torch")].seconds
        predicted = ref if ref >= settings.budget_s else ref + settings.budget_s
        remaining = settings.step_budget_s - (time.perf_counter() - start)
        if predicted <= remaining:
            report(model, "keller_bf16", measure(make_step(model, "keller_bf16"), settings))
        else:
            skipped[model] = predicted
            progress(f"step d={model[0]} x {model[1]}: bf16 row skipped (~{predicted:.0f} s, {remaining:.0f} s left)")

    rows = []
    for model in models:
        hidden_shapes, other_shapes = gpt_shapes(*model)
        shape = {
            "model": list(model),
            "params": sum(math.prod(s) for s in hidden_shapes + other_shapes),
            "hidden_matrices": len(hidden_shapes),
            "ns_gflop_per_step": sum(ns_flops(*s, NS_STEPS) for s in hidden_shapes) / 1e9,
        }
        ref, heavy = timings[(model, "torch")], timings.get((model, "heavyball"))
        for key, (label, _, _, dtype_label) in variants.items():
            row = {**shape, "variant": key, "optimizer": label, "ns_dtype": dtype_label}
            if (model, key) not in timings:
                if key == "heavyball":
                    why: dict[str, Any] = {"skipped": "not installed"}
                elif model in skipped:
                    why = {"skipped_predicted_s": skipped[model]}
                else:  # the forced-bf16 row on a GPU: "keller" already runs in bf16 there
                    why = {"skipped": "same as keller (bf16 is the automatic dtype here)"}
                rows.append({**row, **why})
                continue
            t = timings[(model, key)]
            row.update(ms_per_step=t.seconds * 1e3, reps=t.reps_label, timing=t.as_dict())
            row["ratio_vs_torch"] = t.seconds / ref.seconds
            if heavy is not None and key != "torch":
                row["ratio_vs_heavyball"] = t.seconds / heavy.seconds
            rows.append(row)
    return rows


def _in_processes(settings: Settings) -> list[list[dict[str, Any]]]:
    """``measure_step_rows`` in ``settings.step_processes`` fresh processes, one after another.

    Each process is ``bench_optimizer.py --sections step`` (the entry script above this package).
    """
    script = Path(__file__).resolve().parents[1] / "bench_optimizer.py"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(settings.step_processes):
            out = Path(tmp) / f"step{i}.json"
            command = [sys.executable, str(script), "--sections", "step", "--step-processes", "1", "--out", str(out)]
            command += ["--device", str(settings.device), "--threads", str(torch.get_num_threads())]
            command += ["--step-budget", str(settings.step_budget_s)] + (["--quick"] if settings.quick else [])
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"step table process {i} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            rows = json.loads(out.read_text())["sections"]["step"]["rows"]
            ours = [r for r in rows if r["variant"] in ("keller", "polar_express") and "ratio_vs_torch" in r]
            progress(
                f"step process {i + 1}/{settings.step_processes}: ours/torch "
                + ", ".join(f"d={r['model'][0]} {r['ratio_vs_torch']:.3f}" for r in ours)
            )
            runs.append(rows)
    return runs


def _median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row, the median time and the median of the per-process ratios, with their range."""
    merged = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        if "ms_per_step" not in first:
            merged.append(first)
            continue
        row = {k: v for k, v in first.items() if k not in ("timing", "reps")}
        row["ms_per_step"] = statistics.median(r["ms_per_step"] for r in same)
        row["reps"] = f"{len(runs)}x{min(int(r['reps'].rstrip('*')) for r in same)}"
        kept = ("ms_per_step", "ratio_vs_torch", "ratio_vs_heavyball")
        row["processes"] = [{k: r.get(k) for k in kept} for r in same]
        for key in ("ratio_vs_torch", "ratio_vs_heavyball"):
            if key in first:
                values = [r[key] for r in same]
                row[key] = statistics.median(values)
                row[key.replace("ratio", "range")] = [min(values), max(values)]
        merged.append(row)
    return merged


def bench_step(settings: Settings) -> dict[str, Any]:
    models = _models(settings)
    auto = dtype_name(resolve_ns_dtype(None, settings.device, torch.float32))
    processes = settings.step_processes
    rows = measure_step_rows(settings) if processes == 1 else _median_rows(_in_processes(settings))
    targets, table_rows = [], []
    for row in rows:
        name = f"d={row['model'][0]} x {row['model'][1]}"
        if "ms_per_step" not in row:
            table_rows.append([name, row["optimizer"], row["ns_dtype"], "skipped", "-", "-", "-", "-", "-"])
            continue
        key, ratio = row["variant"], row["ratio_vs_torch"]
        check = ""
        if key in ("keller", "polar_express"):
            bound = _ratio_bound(tuple(row["model"]), settings.device)
            targets.append(target(f"step: {row['optimizer']} / torch, {name}", ratio, "<=", bound))
            check = f"<= {bound}: {verdict(targets[-1]['passed'])}"
        spread = row.get("range_vs_torch")
        table_rows.append(
            [
                name,
                row["optimizer"],
                row["ns_dtype"],
                row["ms_per_step"],
                row["reps"],
                "1 (ref)" if key == "torch" else ratio,
                "-" if spread is None or key == "torch" else f"{spread[0]:.3f}-{spread[1]:.3f}",
                "1 (ref)" if key == "heavyball" else row.get("ratio_vs_heavyball", "-"),
                check,
            ]
        )
    print(
        "\n== step: optimizer.step() time, ours vs torch.optim.Muon and vs heavyball.Muon (hidden),"
        " each + torch.optim.AdamW(foreach) =="
    )
    print(
        f"GPT-like parameters, vocab {VOCAB}; fixed random grads; median ms over reps after one warm-up step;"
        " the reference and ours step in turn (one step each per round, in a random order); the forced-bf16 row"
        " with them where bf16 is the automatic dtype, else alone"
    )
    if processes > 1:
        print(
            f"{processes} fresh processes, one after another: ms/step is the median of their medians, x/torch and"
            " x/heavyball the median of their ratios, range the lowest and highest ratio of one process"
        )
    print("reps 1* = one step exceeded the time budget, so the warm-up step is the sample")
    for model in models:
        r = next(r for r in rows if r["model"] == list(model))
        print(
            f"  d={model[0]} x {model[1]}: {r['params'] / 1e6:.2f} M params, {r['hidden_matrices']} hidden matrices, "
            f"{r['ns_gflop_per_step']:.1f} GFLOP of Newton-Schulz per step"
        )
    headers = ["model", "optimizer", "NS dtype", "ms/step", "reps", "x/torch", "range", "x/heavyball", "target"]
    print(table(headers, table_rows))
    models_json = [list(m) for m in models]
    return {"models": models_json, "auto_dtype": auto, "processes": processes, "rows": rows, "targets": targets}
