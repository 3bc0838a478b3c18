"""Overhead of ``QKClip`` on the demo model, and what measuring the per-head maxima costs.

Two tables, one process:

1. ``== qk_clip overhead``: one row per model shape (the demo model of configs/muon.yaml,
   then two at realistic widths, d=512 and d=768); for each, the same training run (model,
   data, seed) timed without the callback and with ``QKClip(threshold=100)``, alternating;
   next to the ratio, the share of the clipped run's time spent measuring maxima
   (``head_max_logits``, called by the SDPA drop-in) and inside the callback's hook (MAX
   all-reduce when distributed, factors, scaling, logging), timed directly, which
   neighbours on a shared machine disturb far less than the ratio. The verdict checks that
   share against the target (<= 3%) per row. The runs use Lightning's default
   ``log_every_n_steps`` (50): QKClip measures the maxima exactly on the logged steps and,
   on the others, skips ``Q K^T`` for a layer whose q and k norms bound every head under
   the threshold. The last share is the worst case, a clipped run logging (so measuring
   exactly) every step, as every step does once a head's bound exceeds the threshold.
   Beside it, the FLOP model's prediction of the exact measuring share
   (:func:`predicted_share`): the extra ``Q K^T`` is ``2 B T^2 d`` per layer against
   ``72 B T d^2 + 12 B T^2 d`` for a layer's forward and backward, so the share falls like
   ``T / (36 d)`` as the model widens.
2. ``== maxima``: one attention forward at each row's shapes: SDPA alone, SDPA plus the
   drop-in's second ``Q K^T`` and masked max, and (CUDA) flex attention with and without
   the kernel's own ``max_scores``; on CPU torch 2.13 refuses ``max_scores``, and the
   line says so.

Usage::

    python benchmarks/bench_qk_clip.py                 # three shapes, 3 x 2 runs each (30 steps demo, 10 wide)
    python benchmarks/bench_qk_clip.py --quick         # one tiny model, a few steps (smoke test)
    python benchmarks/bench_qk_clip.py --device cuda   # on a GPU

The JSON holds the machine, the settings and every run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from benchlib.harness import check_device, demo_fit, describe_machine, machine_line, sync, write_report

from lightning_muon import QKClip
from lightning_muon.attention import maxima

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_qk_clip.json"
TARGET_OVERHEAD = 0.03
# The trainer's logging interval in the timed runs: Lightning's default. QKClip measures the
# maxima exactly on logged steps; on the others a layer bounded under the threshold by the
# norms of q and k skips Q K^T. The table's last share repeats the clipped run logging every step.
LOG_EVERY = 50

# configs/muon.yaml's model and batch, then two realistic widths (head dim 64, GPT-2 small's
# d=768) at a context of 256 and a batch small enough for seconds per step on a 2-core CPU;
# "steps" is each row's default run length. --quick runs one tiny shape.
DEMO = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32, steps=30)
WIDE = (
    dict(n_layer=2, n_head=8, n_embd=512, block_size=256, batch_size=4, steps=10),
    dict(n_layer=2, n_head=12, n_embd=768, block_size=256, batch_size=4, steps=10),
)
QUICK = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=8, steps=6)
VOCAB = 256  # CharGPTModule's byte vocabulary: the lm_head's width in the FLOP model


def predicted_share(shape: dict[str, int], vocab: int = VOCAB) -> float:
    """The FLOP model's share of a step spent on the maxima's extra ``Q K^T`` product.

    Dense counts (causal skipping ignored on both sides), model FLOPs only (the optimizer
    step, norms and element-wise work left out). Per layer, with ``N = B T`` tokens:

    - linear layers (qkv ``3d^2``, proj ``d^2``, fc1 and fc2 ``8d^2``): forward ``2 N 12 d^2``,
      backward twice that, so ``72 N d^2``;
    - attention ``Q K^T`` and ``P V``: forward ``4 B T^2 d``, backward twice that: ``12 B T^2 d``;
    - the maxima: one more ``Q K^T``, forward only, ``2 B T^2 d``;

    plus the lm_head, ``6 N d V``. Hence share ``= L 2 B T^2 d / (L (72 N d^2 + 14 B T^2 d) +
    6 N d V)``, about ``T / (36 d)`` when ``d`` is large against ``T`` and ``V``.
    """
    L, d, T, B = shape["n_layer"], shape["n_embd"], shape["block_size"], shape["batch_size"]
    n = B * T
    extra = L * 2 * B * T * T * d
    step = L * (72 * n * d * d + 12 * B * T * T * d) + 6 * n * d * vocab
    return extra / (step + extra)


class _TimedQKClip(QKClip):
    """``QKClip`` that adds up the time in its per-step hook and in the maxima measurement."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook = self.measure = 0.0
        self.device = torch.device("cpu")
        self._original = maxima.head_max_logits

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self.device = pl_module.device

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            sync(self.device)  # the attention work queued before is not the measurement's
            t0 = time.perf_counter()
            out = self._original(*args, **kwargs)
            sync(self.device)
            self.measure += time.perf_counter() - t0
            return out

        maxima.head_max_logits = timed  # the SDPA drop-in looks it up at each call

    def on_train_batch_end(self, *args: Any) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        super().on_train_batch_end(*args)
        sync(self.device)
        self.hook += time.perf_counter() - t0

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        maxima.head_max_logits = self._original
        super().teardown(trainer, pl_module, stage)


def _fit(
    shape: dict[str, int], steps: int, clipped: bool, workdir: Path, device: torch.device, log_every: int = LOG_EVERY
) -> dict[str, Any]:
    clip = _TimedQKClip(threshold=100.0) if clipped else None
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(workdir, name="clipped" if clipped else "baseline")
    seconds = demo_fit(shape, steps, device, logger, [clip] if clip else [], log_every)
    return {
        "clipped": clipped,
        "log_every_n_steps": log_every,
        "seconds": seconds,
        "s_per_step": seconds / steps,
        "measure_seconds": clip.measure if clip else 0.0,
        "hook_seconds": clip.hook if clip else 0.0,
    }


def _time(fn: Any, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (and compilation, for flex)
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def attention_costs(shape: dict[str, int], device: torch.device, repeats: int = 10) -> dict[str, Any]:
    """One causal attention forward at the model's shapes: SDPA, SDPA + maxima, flex with/without max_scores."""
    B, H, T = shape["batch_size"], shape["n_head"], shape["block_size"]
    d = shape["n_embd"] // H
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=gen, device=device) for _ in range(3))
    sdpa = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats)
    with_max = _time(
        lambda: (maxima.head_max_logits(q, k, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        device,
        repeats,
    )
    out: dict[str, Any] = {"sdpa_s": sdpa, "sdpa_plus_maxima_s": with_max, "maxima_share": with_max / sdpa - 1}
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    if device.type != "cuda":
        # Ask once, on tiny inputs, what this build says (torch 2.13: not supported on CPU);
        # eager flex attention on CPU would only time an unfused reference implementation.
        tiny = torch.zeros(1, 1, 16, 8)
        try:
            flex_attention(tiny, tiny, tiny, return_aux=AuxRequest(max_scores=True))
            out["flex_note"] = "max_scores available here, not timed on CPU (eager flex is unfused)"
        except NotImplementedError as err:
            out["flex_note"] = str(err).splitlines()[0][:120]
        return out
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, T, T, device=str(device))
    flex = torch.compile(flex_attention)
    plain = _time(lambda: flex(q, k, v, block_mask=mask), device, repeats)
    aux = _time(lambda: flex(q, k, v, block_mask=mask, return_aux=AuxRequest(max_scores=True)), device, repeats)
    out.update(flex_s=plain, flex_max_scores_s=aux, flex_share=aux / plain - 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run, every row (default: demo 30, wide 10, quick 6)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="baseline/clipped pairs (default 3; quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny model and a few steps: a smoke test")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path (git-ignored folder by default)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    args = parser.parse_args(argv)
    if any(v is not None and v < 1 for v in (args.steps, args.repeats)):
        parser.error("--steps and --repeats must be >= 1")
    return check_device(parser, args)


def _model_name(shape: dict[str, int]) -> str:
    dims = ("L", "n_layer"), ("d", "n_embd"), ("H", "n_head"), ("T", "block_size"), ("B", "batch_size")
    return "CharGPT " + " ".join(f"{k}{shape[n]}" for k, n in dims)


def measure_row(
    shape: dict[str, int], steps: int, repeats: int, quick: bool, where: str, workdir: Path, device: torch.device
) -> dict[str, Any]:
    """One table row: warm-up, then ``repeats`` baseline/clipped pairs at ``shape``; the shares and the verdict."""
    _fit(shape, min(steps, 3), True, workdir, device)  # warm-up: imports, allocator, threads, this shape
    runs: list[dict[str, Any]] = []
    every_step: list[dict[str, Any]] = []
    for _ in range(repeats):
        for clipped in (False, True):
            runs.append({"model": _model_name(shape), **_fit(shape, steps, clipped, workdir, device)})
            print(f"  run: {runs[-1]['model']} clipped={clipped} {runs[-1]['s_per_step']:.4f} s/step", file=sys.stderr)
        # The worst case: every step logged, so every step measures its maxima exactly (as
        # every step does once some head's norm bound exceeds the threshold).
        every_step.append({"model": _model_name(shape), **_fit(shape, steps, True, workdir, device, log_every=1)})
    base = statistics.median(r["s_per_step"] for r in runs if not r["clipped"])
    clip = statistics.median(r["s_per_step"] for r in runs if r["clipped"])
    ratio = statistics.median(c["s_per_step"] / b["s_per_step"] for b, c in zip(runs[::2], runs[1::2]))
    share_measure = statistics.median(r["measure_seconds"] / r["seconds"] for r in runs if r["clipped"])
    share_hook = statistics.median(r["hook_seconds"] / r["seconds"] for r in runs if r["clipped"])
    inside = share_measure + share_hook
    worst = statistics.median((r["measure_seconds"] + r["hook_seconds"]) / r["seconds"] for r in every_step)
    predicted = predicted_share(shape)
    verdict = "n/a (quick)" if quick else "ok" if inside <= TARGET_OVERHEAD else "MISS"
    line = (
        f"| {_model_name(shape)} | {steps} | {base:.4f} | {clip:.4f} | {ratio:.3f} ({ratio - 1:+.1%}) "
        f"| {predicted:.2%} | {share_measure:.2%} | {share_hook:.2%} | {inside:.2%} | <= {TARGET_OVERHEAD:.0%} "
        f"| {verdict} | {worst:.2%} | {where} |"
    )
    costs = attention_costs(shape, device)
    flex = (
        f"{costs['flex_s'] * 1e3:.3f} | {costs['flex_max_scores_s'] * 1e3:.3f} ({costs['flex_share']:+.1%})"
        if "flex_s" in costs
        else f"- | {costs.get('flex_note', '-')}"
    )
    maxima_line = (
        f"| {_model_name(shape)} | {costs['sdpa_s'] * 1e3:.3f} | {costs['sdpa_plus_maxima_s'] * 1e3:.3f} "
        f"| {costs['maxima_share']:+.1%} | {flex} | {where} |"
    )
    return {
        "model": shape,
        "steps": steps,
        "runs": runs,
        "attention": costs,
        "baseline_s_per_step": base,
        "clipped_s_per_step": clip,
        "ratio": ratio,
        "predicted_maxima_share": predicted,
        "maxima_share": share_measure,
        "hook_share": share_hook,
        "inside_share": inside,
        "every_step_runs": every_step,
        "inside_share_every_step_exact": worst,
        "target": TARGET_OVERHEAD,
        "verdict": verdict,
        "line": line,
        "maxima_line": maxima_line,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # routing reports, tips
    shapes = [QUICK] if args.quick else [DEMO, *WIDE]
    repeats = args.repeats or (1 if args.quick else 3)
    machine = describe_machine(device)
    gpu = f", GPU {machine['gpu']} ({device})" if device.type == "cuda" else ""
    where = f"{machine['cpu']}, {machine['torch_threads']} threads{gpu}"
    print(f"machine: {machine_line(machine)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            steps = args.steps or shape["steps"]
            rows.append(measure_row(shape, steps, repeats, args.quick, where, Path(tmp), device))
    print(
        "== qk_clip overhead (inside QKClip = maxima + hook, each timed directly; predicted = FLOP model's maxima;"
        f" log_every_n_steps={LOG_EVERY}, Lightning's default; last share: every step logged and measured exactly)"
    )
    print(
        "| model | steps | baseline s/step | QKClip s/step | ratio | predicted maxima | maxima | hook "
        "| inside QKClip | target | verdict | inside QKClip, every step exact | machine |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row["line"])
    print("== maxima (one causal attention forward at each row's shapes, best of 10)")
    print("| model | SDPA ms | SDPA + maxima ms | maxima / SDPA | flex ms | flex + max_scores ms | machine |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row["maxima_line"])
    report = {
        "machine": machine,
        "settings": {"models": shapes, "repeats": repeats, "threshold": 100.0, "steps": [r["steps"] for r in rows]},
        "runs": [run for row in rows for run in row["runs"] + row["every_step_runs"]],
        "rows": [{k: v for k, v in row.items() if k not in ("runs", "every_step_runs")} for row in rows],
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
