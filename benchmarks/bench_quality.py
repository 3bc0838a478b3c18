"""Training quality: Muon and the other matrix algorithms against AdamW on the bundled character-level GPT.

Protocol (every run: the same model size, corpus, step budget, batch size, schedule and
gradient clipping; see ``lightning_muon_demo.experiment``):

1. lr sweep at seed 0: Muon over ``MUON_LRS``, AdamW over ``ADAMW_LRS``, and each new matrix
   algorithm (step 7) over its own three lrs (``EMERGING_LRS``); each one's lr is the one with
   the lowest final validation loss (a run that stops on a non-finite gradient loses).
2. Every row at its chosen lr at seeds 0, 1, 2; curves are averaged over the seeds.
3. AdamW's best mean validation loss is the target: the table gives the first evaluated
   step at which each row's mean curve reaches it, and Muon's step ratio
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
7. The hidden matrices trained by each of the package's other matrix algorithms instead of
   Muon (``RunSpec.matrix_optimizer``; embeddings, head and vectors stay on AdamW): AdaptiveMuon
   with NorMuon's second moment (Muon's lr and keys), Scion, PolarGrad, MOP, SPEL,
   Sinkhorn-Muon (its hidden matrices start Sinkhorn-normalized, the only start it accepts),
   SOAP (plain Shampoo factors) and REKLS, each with its Emerging-Optimizers defaults but the
   lr, swept as in step 1 and run as in step 2; the table gives their final validation loss,
   seed spread, step to AdamW's best and the gap to Muon's final loss.

Usage::

    python benchmarks/bench_quality.py                 # 59 runs
    python benchmarks/bench_quality.py --only emerging # step 7 and Muon's and AdamW's runs: 50 runs
    python benchmarks/bench_quality.py --only emerging --baseline benchmarks/results/bench_quality.json
                                                       # Muon's and AdamW's runs read back: 40 runs
    python benchmarks/bench_quality.py --only scion soap   # some of step 7's rows (and the baseline)
    python benchmarks/bench_quality.py --quick         # 13 tiny runs, every row once (smoke test, ~15 s)
    python benchmarks/bench_quality.py --steps 600 --out /tmp/quality.json
    python benchmarks/bench_quality.py --device cuda   # on a GPU

Time, on an idle 2-core CPU (Xeon, AVX-512): a Muon run 17 s; step 7's runs 17 s
(AdaptiveMuon, Scion, PolarGrad) to 20 s (SPEL, Sinkhorn-Muon), 24 s (MOP's SVDs), 35 s (SOAP)
and 44 s (REKLS's eigendecompositions every step): about 6 min for steps 1-6's 19 runs, 16 min
for step 7's 40, 22 min in all. Runs slow two- to four-fold on a busy machine.

``--baseline PATH`` reads the runs of an earlier report back instead of training them again
(any run whose ``RunSpec`` is the same), once its settings (steps, evaluation interval,
model, seeds, device, Muon's and AdamW's lr grids) are this run's; it refuses one whose
settings differ. Prints the table (``benchlib.quality_table``) and writes JSON (default
benchmarks/results/bench_quality.json, or bench_quality_only.json with ``--only``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from benchlib.harness import check_device, describe_machine, machine_line
from benchlib.quality_table import print_table

from lightning_muon_demo.experiment import RunSpec, steps_to_reach, train


@dataclass(frozen=True)
class Row:
    """One row of the table: a run at the lr a sweep chose, at every seed."""

    label: str
    sweep: str
    """The sweep whose chosen lr the row runs at; a row of the same name is that sweep."""
    spec: dict[str, Any] = field(default_factory=dict)
    """``RunSpec`` fields beside ``lr``, ``seed`` and the budget."""


def _matrix(algorithm: str, **options: Any) -> dict[str, Any]:
    return {"matrix_optimizer": algorithm, "matrix_options": options}


ROWS: dict[str, Row] = {
    "muon": Row("Muon, polar_express", "muon"),
    "adamw": Row("AdamW", "adamw", {"optimizer": "adamw"}),
    "muon_keller": Row("Muon, keller", "muon", {"ns_coefficients": "keller"}),
    "muon_schedulefree": Row(
        "Muon + SF-AdamW, constant", "muon", {"scalar_optimizer": "adamw_schedulefree", "schedule": "constant"}
    ),
    "muon_bf16_state": Row("Muon, bf16 state", "muon", {"state_dtype": "bfloat16"}),
    # Step 7: the other matrix algorithms on the hidden matrices, each swept on its own.
    "adaptive_muon": Row("AdaptiveMuon, normuon", "adaptive_muon", _matrix("adaptive_muon", moment2_method="normuon")),
    "scion": Row("Scion", "scion", _matrix("scion")),
    "polargrad": Row("PolarGrad", "polargrad", _matrix("polargrad")),
    "mop": Row("MOP", "mop", _matrix("mop")),
    "spel": Row("SPEL", "spel", _matrix("spel")),
    "sinkhorn_muon": Row("Sinkhorn-Muon, SK init", "sinkhorn_muon", _matrix("sinkhorn_muon")),
    "soap": Row("SOAP", "soap", _matrix("soap", use_kl_shampoo=False)),
    "rekls": Row("REKLS", "rekls", _matrix("rekls")),
}
BASELINE = ("muon", "adamw")  # AdamW sets the target; Muon is what the others are measured against
EMERGING = ("adaptive_muon", "scion", "polargrad", "mop", "spel", "sinkhorn_muon", "soap", "rekls")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_quality.json"
MUON_LRS = (0.0025, 0.005, 0.01)
ADAMW_LRS = (1e-3, 3e-3, 1e-2)
# Step 7's grids. Smoke runs at the default model size (60 steps, seed 0, the same wsd
# schedule), a decade or more wide, found each algorithm's region; final val loss:
#   Muon           0.01 2.344   0.02 2.339   0.04 2.450     (its 300-step best is 0.01)
#   AdamW          3e-3 2.697   1e-2 2.829                   (its 300-step best is 3e-3)
#   adaptive_muon  0.005 2.397  0.01 2.332   0.02 2.287   0.04 2.409
#   scion          0.01 2.455   0.03 2.396   0.05 2.421   0.1 2.400   0.3 2.474
#   polargrad      0.01 2.504   0.1 2.456    0.3 2.425    1 2.446     3 2.479
#   mop            0.01 2.503   0.1 2.455    0.3 2.428    1 2.417     2 2.425   3 2.452
#   spel           0.01 2.562   0.03 2.472   0.05 2.445   0.1 2.426   0.2 2.436   0.3 2.473
#   sinkhorn_muon  0.03 2.524   0.1 2.522    0.3 2.516    1 2.542     3 3.094
#   soap           1e-3 2.428   3e-3 2.421   1e-2 2.616
#   rekls          1e-3 2.462   3e-3 2.425   1e-2 2.464
# The best lr moves with the run's length (Muon's halves from 60 to 300 steps), so single
# 300-step runs at seed 0 (step 1's) then shifted each grid until its middle lr did best:
#   adaptive_muon  0.005 1.625   0.01 1.605   0.02 1.680     (Muon at 0.01: 1.642)
#   scion          0.00625 1.998  0.0125 1.845  0.025 1.837  0.05 1.891  0.1 1.942
#   polargrad      0.1 1.790     0.3 1.776    1 1.842
#   mop            0.1 1.789     0.3 1.735    1 1.866
#   spel           0.0125 1.855  0.025 1.831  0.05 1.909  0.1 2.011  0.2 2.056
#   sinkhorn_muon  0.1 2.504     0.3 2.504    1 2.511        (flat over the decade)
#   soap           1e-3 1.827    2e-3 1.627   4e-3 1.571   8e-3 1.555   1.6e-2 1.678
#   rekls          1.5e-3 1.822  3e-3 1.639   6e-3 1.619   1.2e-2 1.724
# From 60 to 300 steps the best lr falls for most Muon-like rules (AdaptiveMuon 2x, MOP 3x,
# SPEL 4x; Scion and PolarGrad about the same) and rises for SOAP (3x) and REKLS (2x).
# PolarGrad's and MOP's step is lr times the momentum's nuclear norm, below 1 here (0.15-0.8
# per hidden matrix at the first step, the gradient clipped to norm 1), so their lrs land
# above Muon's. Scion's lr is also its Frank-Wolfe shrink: W <- (1 - lr) W - lr sqrt(out/in) O.
EMERGING_LRS: dict[str, tuple[float, float, float]] = {
    "adaptive_muon": (0.005, 0.01, 0.02),
    "scion": (0.0125, 0.025, 0.05),
    "polargrad": (0.1, 0.3, 1.0),
    "mop": (0.1, 0.3, 1.0),
    "spel": (0.0125, 0.025, 0.05),
    "sinkhorn_muon": (0.1, 0.3, 1.0),
    "soap": (4e-3, 8e-3, 1.6e-2),
    "rekls": (3e-3, 6e-3, 1.2e-2),
}
SEEDS = (0, 1, 2)
# The settings a --baseline report must share with this run (and Muon's and AdamW's lr grids).
BASELINE_SETTINGS = ("steps", "eval_every", "model", "seeds", "device")
# A run at too high an lr can stop on a non-finite gradient (nonfinite="raise") or a failed
# eigendecomposition (SOAP's bases); in a sweep it loses instead of ending the benchmark.
DIVERGED = (FloatingPointError, torch.linalg.LinAlgError)


def _mean_curve(runs: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    steps = runs[0]["steps"]
    for run in runs:
        if run["steps"] != steps:
            raise RuntimeError("runs were evaluated at different steps; cannot average them")
    return steps, [statistics.fmean(values) for values in zip(*(r["val_loss"] for r in runs))]


def _final(run: dict[str, Any]) -> float | None:
    """The run's last validation loss; None when it diverged."""
    return None if run.get("diverged") else run["val_loss"][-1]


def _key(spec: dict[str, Any]) -> str:
    # Through RunSpec: a report written before a field existed names the same run.
    return json.dumps(asdict(RunSpec(**spec)), sort_keys=True)


def _run(spec: RunSpec, log: list[dict[str, Any]], device: str = "cpu") -> dict[str, Any]:
    try:
        result = train(spec, device=device)
    except DIVERGED as err:
        result = {"spec": asdict(spec), "label": spec.label, "steps": [], "val_loss": [], "diverged": str(err)[:500]}
        print(f"  {spec.label:<62} seed {spec.seed}: DIVERGED ({type(err).__name__})")
    else:
        final, seconds = result["val_loss"][-1], result["seconds"]
        print(f"  {spec.label:<62} seed {spec.seed}: final val loss {final:.4f} ({seconds:.0f} s)")
    log.append(result)
    sys.stdout.flush()
    return result


def run_benchmark(
    steps: int,
    eval_every: int,
    grids: dict[str, Sequence[float]],
    seeds: Sequence[int],
    model: dict[str, int],
    device: str = "cpu",
    rows: Sequence[str] = tuple(ROWS),
    reuse: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The protocol of the module docstring for ``rows`` (which must hold ``BASELINE``).

    ``grids`` maps each sweep the rows name to its lrs; ``reuse`` holds earlier runs (a
    report's ``runs``), read back instead of trained where their ``RunSpec`` is the one wanted.
    """
    missing = [name for name in BASELINE if name not in rows]
    if missing:
        raise ValueError(f"rows must include the baseline {BASELINE}, missing {missing}")
    log: list[dict[str, Any]] = []
    earlier = {_key(r["spec"]): r for r in reuse}

    def spec(row: str, lr: float, seed: int) -> RunSpec:
        return RunSpec(lr=lr, seed=seed, steps=steps, eval_every=eval_every, **ROWS[row].spec, **model)

    def run(wanted: RunSpec) -> dict[str, Any]:
        key = _key(asdict(wanted))
        # Seed 0 of a chosen lr already ran in the sweep.
        done = next((r for r in log if _key(r["spec"]) == key), None)
        if done is None and key in earlier:
            done = {**earlier[key], "reused": True}
            log.append(done)
            print(f"  {wanted.label:<62} seed {wanted.seed}: read back from the baseline")
        return done or _run(wanted, log, device)

    sweeps = list(dict.fromkeys(ROWS[row].sweep for row in rows))
    print("1. lr sweep (seed 0)")
    sweep = {name: {lr: _final(run(spec(name, lr, seeds[0]))) for lr in grids[name]} for name in sweeps}
    best_lr: dict[str, float | None] = {}
    for name, losses in sweep.items():
        finished = {lr: loss for lr, loss in losses.items() if loss is not None}
        best_lr[name] = min(finished, key=finished.get) if finished else None
    if best_lr["adamw"] is None:
        raise RuntimeError("every AdamW run of the sweep diverged: there is no target")
    print(f"2. chosen lrs {best_lr}, seeds {list(seeds)}")
    by_seed = {
        row: [] if best_lr[ROWS[row].sweep] is None else [run(spec(row, best_lr[ROWS[row].sweep], s)) for s in seeds]
        for row in rows
    }
    finished = {row: runs for row, runs in by_seed.items() if runs and all(_final(r) is not None for r in runs)}
    if "adamw" not in finished:
        raise RuntimeError("an AdamW run at the chosen lr diverged: there is no target")
    curves = {row: _mean_curve(runs) for row, runs in finished.items()}
    target = min(curves["adamw"][1])
    reach = {row: steps_to_reach(*curves[row], target) if row in curves else None for row in rows}
    ratio = None if reach["muon"] is None else reach["muon"] / reach["adamw"]
    return {
        "rows": {row: {"label": ROWS[row].label, "sweep": ROWS[row].sweep, "spec": ROWS[row].spec} for row in rows},
        "target_val_loss": target,
        "steps_to_target": reach,
        "muon_step_ratio": ratio,
        "final_mean_val_loss": {row: curves[row][1][-1] if row in curves else None for row in rows},
        "final_val_loss_by_seed": {row: [_final(r) for r in runs] for row, runs in by_seed.items()},
        "diverged": {row: [r["spec"]["seed"] for r in runs if r.get("diverged")] for row, runs in by_seed.items()},
        "mean_curves": {row: {"steps": c[0], "val_loss": c[1]} for row, c in curves.items()},
        "sweep_final_val_loss": {name: {str(lr): v for lr, v in losses.items()} for name, losses in sweep.items()},
        "chosen_lr": best_lr,
        "reused_runs": sum(1 for r in log if r.get("reused")),
        "runs": log,
    }


def rows_for(only: Sequence[str] | None) -> tuple[str, ...]:
    """The rows ``--only`` names (``"emerging"``: all of step 7), after the baseline; every row for None."""
    if not only:
        return tuple(ROWS)
    named = [row for name in only for row in (EMERGING if name == "emerging" else (name,))]
    return tuple(dict.fromkeys([*BASELINE, *named]))


def baseline_runs(path: Path, settings: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The runs of the report at ``path`` and its machine, once its settings are ``settings`` (else ValueError).

    The baseline's own lr grids must be this run's; other grids in it may differ (their
    runs are read back only where a ``RunSpec`` matches).
    """
    report = json.loads(path.read_text())
    theirs = report.get("settings")
    if theirs is None:
        raise ValueError(f"{path} has no settings (written before --baseline existed); run the baseline again")

    def matched(values: dict[str, Any]) -> dict[str, Any]:
        # What a baseline run's RunSpec and its numbers depend on; the other rows' grids may differ.
        out = {key: values.get(key) for key in BASELINE_SETTINGS}
        return out | {f"lr_grids[{name!r}]": values.get("lr_grids", {}).get(name) for name in BASELINE}

    ours, there = matched(settings), matched(theirs)
    differ = [f"{key} {there[key]!r} there, {value!r} here" for key, value in ours.items() if there[key] != value]
    if differ:
        raise ValueError(f"{path} was run with other settings: {'; '.join(differ)}")
    return report["runs"], report.get("machine", "unknown machine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="one lr each, one seed, a tiny model (smoke test)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("emerging", *EMERGING),
        help="run these rows of step 7 ('emerging': all of them) and the Muon and AdamW baseline only",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an earlier report whose runs are read back instead of trained (its settings must match)",
    )
    parser.add_argument("--out", type=Path, help=f"JSON output (default {DEFAULT_OUT}; *_only.json with --only)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_OUT.with_name("bench_quality_only.json") if args.only else DEFAULT_OUT
    if args.baseline is not None and not args.baseline.is_file():
        parser.error(f"--baseline {args.baseline}: no such file")
    return check_device(parser, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, batch_size=32)
    grids: dict[str, Sequence[float]] = {"muon": MUON_LRS, "adamw": ADAMW_LRS, **EMERGING_LRS}
    seeds = SEEDS
    if args.quick:
        model = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=8, val_samples=8, max_chars=100_000)
        grids = {"muon": (0.02,), "adamw": (3e-3,), **{name: (lrs[1],) for name, lrs in EMERGING_LRS.items()}}
        seeds = (0,)
        args.steps, args.eval_every = 6, 3
    rows = rows_for(args.only)
    settings = {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "model": model,
        "seeds": list(seeds),
        "device": args.device,
        "lr_grids": {name: list(lrs) for name, lrs in grids.items()},
    }
    reuse: list[dict[str, Any]] = []
    baseline = None
    if args.baseline is not None:
        try:
            reuse, their_machine = baseline_runs(args.baseline, settings)
        except ValueError as err:
            print(f"--baseline: {err}", file=sys.stderr)
            return 2
        baseline = {"path": str(args.baseline), "machine": their_machine}
        print(f"baseline: {args.baseline} ({len(reuse)} runs, {their_machine})")
    tokens = args.steps * model["batch_size"] * model["block_size"]
    budget = f"{args.steps} steps x {model['batch_size']} x {model['block_size']} tokens = {tokens:,} tokens per run"
    machine = machine_line(describe_machine(args.device))
    start = time.perf_counter()
    result = run_benchmark(args.steps, args.eval_every, grids, seeds, model, args.device, rows, reuse)
    print_table(result, machine, budget)
    report = {
        "machine": machine,
        "budget": budget,
        "model": model,
        "settings": settings,
        "baseline": baseline,
        "seconds": time.perf_counter() - start,
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
