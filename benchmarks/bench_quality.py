"""Training quality: Muon against AdamW on the bundled character-level GPT, same token budget.

Protocol (every run: the same model size, corpus, step budget, batch size, schedule and
gradient clipping; see ``lightning_muon_demo.experiment``):

1. lr sweep at seed 0: Muon over ``MUON_LRS``, AdamW over ``ADAMW_LRS``; each optimizer's lr
   is the one with the lowest final validation loss.
2. Both chosen lrs at seeds 0, 1, 2; curves are averaged over the seeds.
3. AdamW's best mean validation loss is the target: the table gives the first evaluated
   step at which each optimizer's mean curve reaches it, and Muon's step ratio
   (target <= 0.70).
4. Muon with the ``keller`` coefficients at the chosen lr and the same seeds, against
   Polar Express (the default), at the same budget.
5. Muon + Schedule-Free AdamW (embeddings, head, vectors; lr ``adamw_lr``) with a
   constant schedule (the same 5% warmup, no cooldown) at Muon's chosen lr and the same
   seeds, against Muon + AdamW with wsd: a run that could stop at any step against one
   that knows its length.
6. Muon + AdamW with every moment stored in bf16 (``exp_avg_dtype`` and
   ``exp_avg_sq_dtype`` = "bfloat16", computed in float32) at Muon's chosen lr and the same
   seeds, against the float32 state: is the difference within the float32 runs' seed spread?

Usage::

    python benchmarks/bench_quality.py                 # 19 runs, about 12-18 min on a 2-core CPU
    python benchmarks/bench_quality.py --quick         # 5 tiny runs (smoke test)
    python benchmarks/bench_quality.py --steps 600 --out /tmp/quality.json
    python benchmarks/bench_quality.py --device cuda   # on a GPU

Prints the table and writes JSON (default benchmarks/results/bench_quality.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness is a sibling script
from harness import check_device, describe_machine, machine_line

from lightning_muon_demo.experiment import RunSpec, steps_to_reach, train

# The runs at the chosen lrs, by name; the optimizer is the name's first word.
VARIANTS: dict[str, dict[str, str]] = {
    "muon": {},
    "adamw": {},
    "muon_keller": {"ns_coefficients": "keller"},
    "muon_schedulefree": {"scalar_optimizer": "adamw_schedulefree", "schedule": "constant"},
    "muon_bf16_state": {"state_dtype": "bfloat16"},
}
LABELS = {
    "adamw": "AdamW",
    "muon": "Muon, polar_express",
    "muon_keller": "Muon, keller",
    "muon_schedulefree": "Muon + SF-AdamW, constant",
    "muon_bf16_state": "Muon, bf16 state",
}

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_quality.json"
MUON_LRS = (0.0025, 0.005, 0.01)
ADAMW_LRS = (1e-3, 3e-3, 1e-2)
SEEDS = (0, 1, 2)
STEP_RATIO_MAX = 0.70


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    steps = runs[0]["steps"]
    for run in runs:
        if run["steps"] != steps:
            raise RuntimeError("runs were evaluated at different steps; cannot average them")
    return steps, [statistics.fmean(values) for values in zip(*(r["val_loss"] for r in runs))]


def _run(spec: RunSpec, log: list[dict[str, Any]], device: str = "cpu") -> dict[str, Any]:
    result = train(spec, device=device)
    log.append(result)
    final, seconds = result["val_loss"][-1], result["seconds"]
    print(f"  {spec.label:<34} seed {spec.seed}: final val loss {final:.4f} ({seconds:.0f} s)")
    sys.stdout.flush()
    return result


def run_benchmark(
    steps: int, eval_every: int, muon_lrs, adamw_lrs, seeds, model: dict[str, int], device: str = "cpu"
) -> dict[str, Any]:
    log: list[dict[str, Any]] = []

    def spec(optimizer: str, lr: float, seed: int, **variant: str) -> RunSpec:
        return RunSpec(optimizer=optimizer, lr=lr, seed=seed, steps=steps, eval_every=eval_every, **variant, **model)

    print("1. lr sweep (seed 0)")
    sweep = {
        name: {lr: _run(spec(name, lr, seeds[0]), log, device)["val_loss"][-1] for lr in lrs}
        for name, lrs in (("muon", muon_lrs), ("adamw", adamw_lrs))
    }
    best_lr = {name: min(losses, key=losses.get) for name, losses in sweep.items()}
    print(f"2. chosen lrs {best_lr}, seeds {list(seeds)}")
    by_seed: dict[str, list[dict[str, Any]]] = {}
    for name, variant in VARIANTS.items():
        optimizer = name.split("_")[0]
        runs = []
        for seed in seeds:
            wanted = spec(optimizer, best_lr[optimizer], seed, **variant)
            # Seed 0 of the chosen lrs already ran in the sweep.
            done = next((r for r in log if r["spec"] == asdict(wanted)), None)
            runs.append(done or _run(wanted, log, device))
        by_seed[name] = runs
    curves = {name: _mean_curve(runs) for name, runs in by_seed.items()}
    target = min(curves["adamw"][1])
    reach = {name: steps_to_reach(*curves[name], target) for name in curves}
    ratio = None if reach["muon"] is None else reach["muon"] / reach["adamw"]
    return {
        "target_val_loss": target,
        "steps_to_target": reach,
        "muon_step_ratio": ratio,
        "final_mean_val_loss": {name: curve[1][-1] for name, curve in curves.items()},
        "final_val_loss_by_seed": {name: [r["val_loss"][-1] for r in runs] for name, runs in by_seed.items()},
        "mean_curves": {name: {"steps": c[0], "val_loss": c[1]} for name, c in curves.items()},
        "sweep_final_val_loss": {name: {str(lr): v for lr, v in losses.items()} for name, losses in sweep.items()},
        "chosen_lr": best_lr,
        "runs": log,
    }


def print_table(result: dict[str, Any], machine: str, budget: str) -> None:
    reach, final = result["steps_to_target"], result["final_mean_val_loss"]
    seeds = result["final_val_loss_by_seed"]
    print(f"\nmachine: {machine}")
    print(f"budget: {budget}")
    print(f"lr sweep, final val loss at seed 0: {json.dumps(result['sweep_final_val_loss'])}")
    print(f"target: AdamW's best mean val loss {result['target_val_loss']:.4f}\n")
    print(f"{'run':<26}{'lr':>8}{'final val (mean)':>18}{'seed spread':>13}{'steps to target':>17}")
    for name, label in LABELS.items():
        lr = result["chosen_lr"][name.split("_")[0]]
        spread = max(seeds[name]) - min(seeds[name])
        steps = "never" if reach[name] is None else str(reach[name])
        print(f"{label:<26}{lr:>8g}{final[name]:>18.4f}{spread:>13.4f}{steps:>17}")
    ratio = result["muon_step_ratio"]
    verdict = "n/a" if ratio is None else ("ok" if ratio <= STEP_RATIO_MAX else "MISSED")
    shown = "Muon never reached it" if ratio is None else f"{ratio:.3f}"
    print(f"\nMuon steps / AdamW steps to AdamW's best: {shown}  (target <= {STEP_RATIO_MAX}: {verdict})")
    gap = final["muon"] - final["muon_keller"]
    print(f"Polar Express - keller final val loss at the same budget: {gap:+.4f} (negative: Polar Express better)")
    gap = final["muon_schedulefree"] - final["muon"]
    print(
        f"Muon + Schedule-Free AdamW (constant) - Muon + AdamW (wsd) final val loss: {gap:+.4f} "
        "(negative: Schedule-Free better)"
    )
    gap, spread = final["muon_bf16_state"] - final["muon"], max(seeds["muon"]) - min(seeds["muon"])
    verdict = "within" if abs(gap) <= spread else "OUTSIDE"
    print(
        f"Muon bf16 state - float32 state final val loss: {gap:+.4f} ({verdict} the float32 seed spread {spread:.4f})"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="one lr each, one seed, a tiny model (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args(argv)
    return check_device(parser, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=32)
    muon_lrs, adamw_lrs, seeds = MUON_LRS, ADAMW_LRS, SEEDS
    if args.quick:
        model = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, val_samples=8, max_chars=100_000)
        muon_lrs, adamw_lrs, seeds = (0.02,), (3e-3,), (0,)
        args.steps, args.eval_every = 6, 3
    tokens = args.steps * model["batch_size"] * model["block_size"]
    budget = f"{args.steps} steps x {model['batch_size']} x {model['block_size']} tokens = {tokens:,} tokens per run"
    machine = machine_line(describe_machine(args.device))
    start = time.perf_counter()
    result = run_benchmark(args.steps, args.eval_every, muon_lrs, adamw_lrs, seeds, model, args.device)
    print_table(result, machine, budget)
    report = {"machine": machine, "budget": budget, "model": model, "seconds": time.perf_counter() - start, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
