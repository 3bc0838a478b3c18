"""``bench_optimizer.py``'s memory section: one process, the step table's GPT-like parameters.

Ours (``Muon``: hidden matrices to Muon, the rest to AdamW) against ``torch.optim.Muon`` +
``torch.optim.AdamW`` (foreach) and ``torch.optim.AdamW`` (foreach) on everything, on
``step_table.gpt_parameters`` (d=768 x 12, fp32, fixed random grads; d=64 x 2 quick), the
second ``step()`` measured (``memory.StepMeter``). Ours runs with ``--step-memory-mb`` (else
the library's default cap) and again with no cap (``step_memory_mb=None``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from benchlib.harness import dtype_name, progress, table, target, verdict
from benchlib.memory import (
    StepMeter,
    header_lines,
    knob_label,
    measure,
    mib,
    our_kwargs,
    print_sites,
    print_targets,
    storages,
    torch_adamw,
)
from benchlib.step_table import (
    LR,
    MOMENTUM,
    WEIGHT_DECAY,
    gpt_parameters,
    our_optimizer,
)
from lightning_muon.newton_schulz import resolve_ns_dtype

# Targets (benchmarks/README.md, "Memory").
TRANSIENT_RATIO_MAX = 1.25  # ours' transient <= 1.25 x torch.optim.Muon + AdamW's
STATE_RATIO_MAX = 0.51  # ours' state <= 0.51 x AdamW's (one buffer per matrix, not two)


def model_size(quick: bool) -> tuple[int, int]:
    """(d, layers) of the parameters measured."""
    return (64, 2) if quick else (768, 12)


def _variants(cfg: dict[str, Any], auto: str) -> dict[str, tuple[str, str, Callable]]:
    """key -> (label, Newton-Schulz dtype shown, build(hidden, other) -> optimizers)."""
    ours = our_kwargs(cfg)
    variants: dict[str, tuple[str, str, Callable]] = {
        "ours": (
            f"ours ({knob_label(cfg)})",
            auto,
            lambda h, o: [our_optimizer(h, o, "polar_express", None, **ours)],
        ),
        "ours_unbounded": (
            "ours, unbounded (step_memory_mb=None)",
            auto,
            lambda h, o: [our_optimizer(h, o, "polar_express", None, step_memory_mb=None)],
        ),
    }
    if auto != "bfloat16":  # torch.optim.Muon iterates in bf16: ours at the same dtype too
        variants["ours_bf16"] = (
            "ours, bf16 Newton-Schulz",
            "bfloat16 (forced)",
            lambda h, o: [our_optimizer(h, o, "polar_express", "bfloat16", **ours)],
        )

    def torch_reference(h: list[Tensor], o: list[Tensor]) -> list[torch.optim.Optimizer]:
        muon = torch.optim.Muon(
            h, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=True, adjust_lr_fn="original"
        )
        return [muon, torch_adamw(o)]

    variants["torch"] = ("torch.optim.Muon + AdamW", "bfloat16 (always)", torch_reference)
    variants["adamw"] = ("torch.optim.AdamW", "-", lambda h, o: [torch_adamw(h + o)])
    return variants


def bench_memory(cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(cfg["device"])
    d, layers = cfg["single_model"]
    auto = dtype_name(resolve_ns_dtype(None, device, torch.float32))
    rows = []
    for key, (label, ns_dtype, build) in _variants(cfg, auto).items():
        hidden, other = gpt_parameters(d, layers, device)
        optimizers = build(hidden, other)

        def step(optimizers: list[torch.optim.Optimizer] = optimizers) -> None:
            for opt in optimizers:
                opt.step()

        step()  # the first step makes the state; the second is measured
        t0 = time.perf_counter()
        row = measure(step, StepMeter(device, hidden + other, optimizers))
        progress(
            f"single d={d} x {layers}: {label}: peak {mib(row['peak_bytes']):.1f} MiB "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        row.update(
            variant=key,
            optimizer=label,
            ns_dtype=ns_dtype,
            hidden_param_bytes=sum(storages(hidden, device).values()),
            other_tensors=len(other),
        )
        rows.append(row)
        del hidden, other, optimizers, step
    by_key = {r["variant"]: r for r in rows}
    torch_row, adamw_row = by_key["torch"], by_key["adamw"]
    for row in rows:
        row["state_per_params"] = row["state_bytes"] / row["params_bytes"]
        row["state_per_adamw_state"] = row["state_bytes"] / adamw_row["state_bytes"]
        row["transient_per_torch"] = row["transient_bytes"] / torch_row["transient_bytes"]
    ours = by_key["ours"]
    name = f"d={d} x {layers}"
    targets = [
        target(
            f"single: ours' transient / torch.optim.Muon + AdamW's, {name}",
            ours["transient_per_torch"],
            "<=",
            TRANSIENT_RATIO_MAX,
        ),
        target(f"single: ours' state / AdamW's, {name}", ours["state_per_adamw_state"], "<=", STATE_RATIO_MAX),
    ]
    return {"model": [d, layers], "auto_ns_dtype": auto, "rows": rows, "targets": targets}


def print_memory(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    d, layers = section["model"]
    rows = section["rows"]
    first = rows[0]
    other_bytes = first["params_bytes"] - first["hidden_param_bytes"]
    print(f"\n== single: one process, GPT-like parameters d={d} x {layers}, fp32, fixed random grads; second step() ==")
    print(
        f"params {mib(first['params_bytes']):.1f} MiB ({mib(first['hidden_param_bytes']):.1f} in "
        f"hidden matrices, {mib(other_bytes):.1f} in {first['other_tensors']} other tensors), grads the same; "
        f"Newton-Schulz automatic dtype here: {section['auto_ns_dtype']}"
    )
    t_tr, t_st = section["targets"]  # ours' transient, ours' state
    table_rows = []
    for r in rows:
        check = ""
        if r["variant"] == "ours":
            check = (
                f"transient <= {TRANSIENT_RATIO_MAX}: {verdict(t_tr['passed'])}; "
                f"state <= {STATE_RATIO_MAX}: {verdict(t_st['passed'])}"
            )
        table_rows.append(
            [
                r["optimizer"],
                r["ns_dtype"],
                mib(r["state_bytes"]),
                r["state_per_params"],
                r["state_per_adamw_state"],
                mib(r["peak_bytes"]),
                mib(r["transient_bytes"]),
                r["transient_per_torch"],
                check,
            ]
        )
    headers = ["optimizer", "NS dtype", "state MiB", "state / params", "state / AdamW's", "peak MiB"]
    headers += ["transient MiB", "transient / torch.optim.Muon's", "target"]
    print(table(headers, table_rows))
    print("state counts AdamW's step counters (4 bytes per tensor); transient = peak - params - grads - state")
    print_sites([(r["optimizer"], r) for r in rows])
    print_targets(section["targets"])


def bench_memory_section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The section as ``bench_optimizer.py`` runs it: the memory lines, then the table."""
    print(f"\n{header_lines(cfg)}")
    section = bench_memory(cfg)
    print_memory(section, cfg)
    return section
