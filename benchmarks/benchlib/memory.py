"""Memory per rank of one optimizer step: the meter, the flags and the tables the memory measurements share.

For every configuration the same numbers, per rank, in bytes (printed in MiB):

- params, grads: the storages of the parameters and of their gradients as the step starts
  (this rank's shards under FSDP2);
- state: the storages of every tensor in ``optimizer.state`` (momentum, AdamW's moments and
  its 4-byte step counters, listed apart as ``counters``);
- kept: buffers a sharding keeps between steps (none today: ``muon_ddp``'s exchange runs in
  rounds), counted apart when a configuration names them;
- peak: the most memory held while the step runs;
- transient = peak - params - grads - state: what the step adds on top (kept buffers included).

On CPU the peak comes from torch's own tracker, ``torch.distributed._tools.mem_tracker.MemTracker``
(a dispatch mode: it sees every tensor an operator allocates, not the scratch memory inside
one kernel). It is told of the params, grads, state and kept buffers before the step and
tracks what the step allocates; the second step is the one measured, so the state exists
already. On CUDA the peak is ``torch.cuda.max_memory_allocated()`` after
``torch.cuda.reset_peak_memory_stats()``, less what was allocated before the step, added to
params + grads + state + kept.

The measurements live beside what they measure, each against its reference in the same run:
``bench_optimizer.py --sections memory`` (one process: ``memory_optimizer``),
``bench_ddp.py``, ``bench_fsdp.py`` and ``bench_tp.py`` with ``--memory`` (``memory_ranks``),
``bench_spectra.py --memory`` (the callbacks: ``memory_callbacks``). ``--step-memory-mb``
is passed to every ``Muon`` as ``step_memory_mb`` (the most MiB of temporaries one Muon
group's step may hold).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker

from benchlib.harness import describe_machine, machine_line, table, targets_met, verdict, write_report
from benchlib.step_table import ADAMW_BETAS, ADAMW_EPS, ADAMW_LR
from lightning_muon import Muon

MIB = 2**20
BENCHMARKS = str(Path(__file__).resolve().parents[1])  # frames of the benchmarks' own code
SectionFns = tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[dict[str, Any], dict[str, Any]], None]]

# ---------------------------------------------------------------- the flags and Muon's step_memory_mb


def step_memory_arg(value: str) -> float | str | None:
    """``--step-memory-mb``: a number of MiB > 0, ``auto`` or ``none`` (no cap)."""
    if value.lower() in ("auto", "none"):
        return None if value.lower() == "none" else "auto"
    try:
        mb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, 'auto' or 'none', got {value!r}") from None
    if not mb > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return mb


def add_memory_arguments(parser: argparse.ArgumentParser, what: str | None) -> None:
    """``--step-memory-mb``, and ``--memory`` (helped by ``what`` it measures) unless ``what`` is None."""
    if what is not None:
        parser.add_argument(
            "--memory",
            action="store_true",
            help=f"measure memory per rank of one optimizer step instead: {what} (benchmarks/README.md, 'Memory')",
        )
    parser.add_argument(
        "--step-memory-mb",
        type=step_memory_arg,
        default=argparse.SUPPRESS,
        help="with the memory measurement: Muon's step_memory_mb (MiB of temporaries one Muon step may hold; "
        "'auto' or 'none' also taken), passed to every Muon (default: the library's)",
    )


def memory_settings(args: argparse.Namespace, threads: int = 1, **section: Any) -> dict[str, Any]:
    """The settings a memory measurement reads: the flags, and ``section``'s own (its model, its world)."""
    given = hasattr(args, "step_memory_mb")
    return {
        "quick": args.quick,
        "device": args.device,
        "threads": threads,
        **section,
        "step_memory_given": given,
        "step_memory_mb": args.step_memory_mb if given else None,
    }


def default_step_memory() -> Any:
    """``Muon``'s default ``step_memory_mb``, read from its signature."""
    return inspect.signature(Muon).parameters["step_memory_mb"].default


def our_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """``Muon``'s keywords from the flags: ``step_memory_mb`` where it was given."""
    return {"step_memory_mb": cfg["step_memory_mb"]} if cfg["step_memory_given"] else {}


def knob_label(cfg: dict[str, Any]) -> str:
    value = cfg["step_memory_mb"] if cfg["step_memory_given"] else default_step_memory()
    return f"step_memory_mb={value}" + ("" if cfg["step_memory_given"] else ", the default")


def header_lines(cfg: dict[str, Any]) -> str:
    """How the peak was measured, and Muon's step_memory_mb: the lines above every memory table."""
    how = "MemTracker (torch.distributed._tools)" if cfg["device"] == "cpu" else "torch.cuda.max_memory_allocated"
    return f"peak measured with {how}; MiB = 2^20 bytes\nMuon's step_memory_mb: {knob_label(cfg)}"


# ---------------------------------------------------------------- measuring one step


def storages(tensors: Iterable[Tensor | None], device: torch.device) -> dict[int, int]:
    """The distinct storages (a DTensor: its local one) of ``tensors`` on ``device``'s type: id -> bytes."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        for st in get_untyped_storages(t):
            if st.device.type == device.type and st.nbytes():
                out[st._cdata] = st.nbytes()
    return out


def state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[Tensor]:
    return [v for opt in optimizers for entry in opt.state.values() for v in entry.values() if isinstance(v, Tensor)]


def _op_name(func: Any) -> str:
    return str(func).removesuffix(".default")


class PeakTracker(MemTracker):
    """``MemTracker`` that also notes where the step was when the peak was reached.

    The site is the innermost frame in ``lightning_muon`` or ``torch.optim`` (else the
    innermost outside the tracker and the benchmarks' own code) and the operator that allocated.
    """

    def __init__(self) -> None:
        super().__init__()
        self._func: Any = None
        self.peak_at = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._func = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.peak_at = self._site()

    def _site(self) -> str:
        frame, fallback = sys._getframe(2), None
        while frame is not None:
            path = frame.f_code.co_filename
            ours = "_tools" in path or "_python_dispatch" in path or path.startswith(BENCHMARKS)
            if fallback is None and not ours:
                fallback = frame
            if "lightning_muon" in path or "torch/optim" in path.replace("\\", "/"):
                break
            frame = frame.f_back
        frame = frame or fallback
        where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}" if frame else "?"
        return f"{where} ({_op_name(self._func)})"


class StepMeter:
    """Bytes of params, grads, state and kept buffers when ``start`` is called; the peak up to ``stop``."""

    def __init__(
        self,
        device: torch.device,
        params: list[Tensor],
        optimizers: list[torch.optim.Optimizer],
        kept: Callable[[], list[Tensor]] = list,
    ) -> None:
        self.device, self.params, self.optimizers, self.kept = device, params, optimizers, kept
        self.tracker: PeakTracker | None = None

    def start(self) -> None:
        device, grads = self.device, [p.grad for p in self.params]
        state = state_tensors(self.optimizers)
        parts = {
            "params": storages(self.params, device),
            "grads": storages(grads, device),
            "state": storages(state, device),
            "kept": storages(self.kept(), device),
        }
        counters = storages([t for t in state if t.ndim == 0], device)
        self.sizes = {f"{k}_bytes": sum(v.values()) for k, v in parts.items()}
        self.sizes["state_counter_bytes"] = sum(counters.values())
        everything = {k: v for part in parts.values() for k, v in part.items()}
        self.sizes["distinct_bytes"] = sum(everything.values())  # a storage in two parts counts once
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.before = torch.cuda.memory_allocated(device)
            return
        self.tracker = PeakTracker()
        kept = self.kept()
        self.tracker.track_external(*self.params, *[g for g in grads if g is not None], *state, *kept)
        self.tracker.__enter__()
        self.at_start = self._total("current")

    def _total(self, kind: str) -> int:
        snapshot = self.tracker.get_tracker_snapshot(kind)
        return snapshot.get(torch.device(self.device.type), {}).get("Total", 0)

    def stop(self) -> dict[str, Any]:
        s = self.sizes
        out: dict[str, Any] = dict(s)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            growth = torch.cuda.max_memory_allocated(self.device) - self.before
            out["peak_bytes"] = s["params_bytes"] + s["grads_bytes"] + s["state_bytes"] + s["kept_bytes"] + growth
            out["peak_at"] = None
        else:
            self.tracker.__exit__(None, None, None)
            out["peak_bytes"] = self._total("peak")
            out["tracked_at_start_bytes"] = self.at_start
            out["peak_at"] = self.tracker.peak_at
            self.tracker = None
        out["transient_bytes"] = out["peak_bytes"] - s["params_bytes"] - s["grads_bytes"] - s["state_bytes"]
        return out


def measure(step: Callable[[], Any], meter: StepMeter) -> dict[str, Any]:
    """``step()`` between ``meter.start()`` and ``meter.stop()``; returns what the meter measured."""
    meter.start()
    try:
        step()
    finally:
        result = meter.stop()
    return result


def mib(n: float) -> float:
    return n / MIB


def torch_adamw(params: list[Tensor], foreach: bool = True) -> torch.optim.AdamW:
    """The reference every table measures against: torch's AdamW with the step table's hyperparameters."""
    return torch.optim.AdamW(params, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0, foreach=foreach)


# ---------------------------------------------------------------- tables


def print_sites(rows: list[tuple[str, dict[str, Any]]]) -> None:
    sites = [(label, r["peak_at"]) for label, r in rows if r.get("peak_at")]
    if sites:
        print("peak reached at (innermost frame of lightning_muon or torch.optim, and the allocating op):")
        for label, site in sites:
            print(f"  {label}: {site}")


def print_targets(targets: list[dict[str, Any]]) -> None:
    for t in targets:
        print(f"target {t['name']}: {t['value']:.3f} {t['op']} {t['bound']} {verdict(t['passed'])}")


def rank_rows(ranks: list[dict[str, Any]], configs: dict[str, str], ref: str) -> list[dict[str, Any]]:
    """A row per rank and configuration, with its state and peak over the reference's on that rank."""
    rows = []
    for r, rank in enumerate(ranks):
        for key, label in configs.items():
            row = {"config": key, "label": label, "rank": r, **rank[key]}
            row["peak_per_ref"] = row["peak_bytes"] / rank[ref]["peak_bytes"]
            row["state_per_ref"] = row["state_bytes"] / rank[ref]["state_bytes"]
            rows.append(row)
    return rows


def print_rank_table(title: str, note: str, rows: list[dict[str, Any]], ref_label: str) -> None:
    print(title)
    headers = ["config", "rank", "params MiB", "grads MiB", "state MiB", "kept MiB", "peak MiB", "transient MiB"]
    headers += [f"state / {ref_label}'s", f"peak / {ref_label}'s"]
    cells = [
        [
            r["label"],
            r["rank"],
            mib(r["params_bytes"]),
            mib(r["grads_bytes"]),
            mib(r["state_bytes"]),
            mib(r["kept_bytes"]),
            mib(r["peak_bytes"]),
            mib(r["transient_bytes"]),
            r["state_per_ref"],
            r["peak_per_ref"],
        ]
        for r in rows
    ]
    print(table(headers, cells))
    print(note)
    print_sites([(f"{r['label']}, rank 0", r) for r in rows if r["rank"] == 0])


# ---------------------------------------------------------------- a --memory run


def run_memory(cfg: dict[str, Any], sections: dict[str, SectionFns], out: Path) -> int:
    """Measures and prints each of ``sections`` (name -> (measure, print)), then writes the JSON report."""
    machine = describe_machine(cfg["device"])
    run = "quick" if cfg["quick"] else "full"
    print(f"lightning_muon: memory per rank of an optimizer step ({run}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_line(machine)}")
    print(header_lines(cfg))
    start = time.perf_counter()
    results: dict[str, Any] = {}
    for name, (measure_section, print_section) in sections.items():
        t0 = time.perf_counter()
        results[name] = measure_section(cfg)
        results[name]["elapsed_s"] = time.perf_counter() - t0
        print_section(results[name], cfg)
    targets = [t for s in results.values() for t in s.get("targets", [])]
    elapsed = time.perf_counter() - start
    print(f"\ntargets met: {sum(t['passed'] for t in targets)} of {len(targets)}; total {elapsed:.1f} s")
    report = {
        "machine": machine,
        "settings": {**cfg, "step_memory_default": default_step_memory()},
        "sections": results,
        "targets": targets,
        **targets_met(targets),
        "elapsed_s": elapsed,
    }
    write_report(out, report)
    return 0
