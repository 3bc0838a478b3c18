"""``bench_quality.py``'s table: each row's final loss, seed spread, steps to AdamW's best, and the checks.

``print_table`` prints a result of ``bench_quality.run_benchmark``: per row the chosen lr,
the final validation loss averaged over the seeds, its seed spread, the first evaluated step
at which the mean curve reaches AdamW's best, and the gap to Muon; then Muon's step ratio
against its target and the side-by-side gaps (keller, Schedule-Free, bf16 state).
"""

from __future__ import annotations

import json
from typing import Any

STEP_RATIO_MAX = 0.70  # Muon's steps to AdamW's best mean val loss <= 0.70 x AdamW's (benchmarks/README.md)


def print_table(result: dict[str, Any], machine: str, budget: str) -> None:
    reach, final = result["steps_to_target"], result["final_mean_val_loss"]
    seeds, rows = result["final_val_loss_by_seed"], result["rows"]
    print(f"\nmachine: {machine}")
    print(f"budget: {budget}")
    print(f"lr sweep, final val loss at seed 0: {json.dumps(result['sweep_final_val_loss'])}")
    print(f"target: AdamW's best mean val loss {result['target_val_loss']:.4f}\n")
    head = f"{'run':<28}{'lr':>8}{'final val (mean)':>18}{'seed spread':>13}{'steps to target':>17}{'- Muon':>9}"
    print(head)
    for name, row in rows.items():
        lr = result["chosen_lr"][row["sweep"]]
        if final[name] is None:
            what = "diverged at every lr" if lr is None else f"diverged (seeds {result['diverged'][name]})"
            print(f"{row['label']:<28}{'-' if lr is None else f'{lr:g}':>8}  {what}")
            continue
        spread = max(seeds[name]) - min(seeds[name])
        steps = "never" if reach[name] is None else str(reach[name])
        gap = "" if name == "muon" or final["muon"] is None else f"{final[name] - final['muon']:+.4f}"
        print(f"{row['label']:<28}{lr:>8g}{final[name]:>18.4f}{spread:>13.4f}{steps:>17}{gap:>9}")
    ratio = result["muon_step_ratio"]
    verdict = "n/a" if ratio is None else ("ok" if ratio <= STEP_RATIO_MAX else "MISSED")
    shown = "Muon never reached it" if ratio is None else f"{ratio:.3f}"
    print(f"\nMuon steps / AdamW steps to AdamW's best: {shown}  (target <= {STEP_RATIO_MAX}: {verdict})")
    if final["muon"] is None:
        return
    if final.get("muon_keller") is not None:
        gap = final["muon"] - final["muon_keller"]
        print(f"Polar Express - keller final val loss at the same budget: {gap:+.4f} (negative: Polar Express better)")
    if final.get("muon_schedulefree") is not None:
        gap = final["muon_schedulefree"] - final["muon"]
        print(
            f"Muon + Schedule-Free AdamW (constant) - Muon + AdamW (wsd) final val loss: {gap:+.4f} "
            "(negative: Schedule-Free better)"
        )
    if final.get("muon_bf16_state") is not None:
        gap, spread = final["muon_bf16_state"] - final["muon"], max(seeds["muon"]) - min(seeds["muon"])
        verdict = "within" if abs(gap) <= spread else "OUTSIDE"
        print(
            f"Muon bf16 state - float32 state final val loss: {gap:+.4f} "
            f"({verdict} the float32 seed spread {spread:.4f})"
        )
