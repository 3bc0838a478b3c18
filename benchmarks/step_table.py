"""The step table of ``bench_optimizer.py``: ``Muon.step`` against torch.optim.Muon and heavyball.Muon.

A GPT-like parameter set with fixed random gradients (``gpt_parameters``); our hybrid
``Muon`` (Newton-Schulz on the hidden matrices, AdamW on the rest) against
``torch.optim.Muon`` + ``torch.optim.AdamW`` with the same hyperparameters, and against
heavyball's compiled Muon where it is installed. benchmarks/README.md says which targets
the ratios check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from harness import dtype_name, progress, table, target, verdict
from ns_tables import NS_STEPS
from timing import Settings, Timing, measure, measure_interleaved
from torch import Tensor

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
    auto = dtype_name(resolve_ns_dtype(None, device, torch.float32))
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
        keys = ("torch", "heavyball", "keller", "polar_express") + (("keller_bf16",) if auto == "bfloat16" else ())
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
                targets.append(target(f"step: {label} / torch, d={model[0]} x {model[1]}", ratio, "<=", bound))
                check = f"<= {bound}: {verdict(targets[-1]['passed'])}"
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
    print(
        f"GPT-like parameters, vocab {VOCAB}; fixed random grads; median ms over reps after one warm-up step;"
        " the reference and ours step in turn (one step each per round); the forced-bf16 row with them where"
        " bf16 is the automatic dtype, else alone"
    )
    print("reps 1* = one step exceeded the time budget, so the warm-up step is the sample")
    for model in models:
        r = next(r for r in rows if r["model"] == list(model) and "params" in r)
        print(
            f"  d={model[0]} x {model[1]}: {r['params'] / 1e6:.2f} M params, {r['hidden_matrices']} hidden matrices, "
            f"{r['ns_gflop_per_step']:.1f} GFLOP of Newton-Schulz per step"
        )
    print(table(["model", "optimizer", "NS dtype", "ms/step", "reps", "x/torch", "x/heavyball", "target"], table_rows))
    return {"models": [list(m) for m in models], "auto_dtype": auto, "rows": rows, "targets": targets}
