"""Benchmark: memory per rank of one optimizer step: the optimizer state, the peak during ``step()``, the transient.

For every configuration the same numbers, per rank, in bytes (printed in MiB):

- params, grads: the storages of the parameters and of their gradients as the step starts
  (this rank's shards under FSDP2);
- state: the storages of every tensor in ``optimizer.state`` (momentum, AdamW's moments and
  its 4-byte step counters, listed apart as ``counters``);
- kept: buffers a sharding keeps between steps (``muon_ddp``'s flat send/receive buffers);
- peak: the most memory held while the step runs;
- transient = peak - params - grads - state: what the step adds on top (kept buffers included).

On CPU the peak comes from torch's own tracker, ``torch.distributed._tools.mem_tracker.MemTracker``
(a dispatch mode: it sees every tensor an operator allocates, not the scratch memory inside
one kernel). It is told of the params, grads, state and kept buffers before the step and
tracks what the step allocates; the second step is the one measured, so the state exists
already. On CUDA the peak is ``torch.cuda.max_memory_allocated()`` after
``torch.cuda.reset_peak_memory_stats()``, less what was allocated before the step, added to
params + grads + state + kept.

Sections (``--sections``), each against its reference in the same run:

- ``single``: one process, GPT-like parameters (``step_table.gpt_parameters``, d=768 x 12,
  fp32, fixed random grads): ours (``Muon``: hidden matrices to Muon, the rest to AdamW)
  against ``torch.optim.Muon`` + ``torch.optim.AdamW`` (foreach) and ``torch.optim.AdamW``
  (foreach) on everything;
- ``ddp``: ``muon_ddp`` (``MuonSharding``, ``reduce_scatter``, the reduce inside the measured
  step) at W=2 against plain DDP with AdamW and DDP with our ``Muon`` replicated
  (every rank steps everything), CharGPT d=768 x 2;
- ``fsdp``: ``muon_fsdp`` (``MuonFSDPSharding``, owner mode) at W=2 against FSDP2
  (``fully_shard``) with AdamW, foreach and for-loop;
- ``mesh``: the 2 x 2 (data x tensor) mesh of ``bench_tp.py`` (4 ranks), ``Muon`` +
  ``MuonTPSharding`` in each ``tp_mode`` against AdamW;
- ``callbacks``: one process, a Lightning fit of the demo CharGPT, the second optimizer
  step (``on_before_optimizer_step`` to the end of ``on_train_batch_end``) with
  ``UpdateSpectrumMonitor`` (every step) and ``QKClip`` (a threshold under the logits, so
  that heads are clipped) against none.

``--step-memory-mb`` is passed to ``Muon`` where it takes ``step_memory_mb`` (the most MiB of
temporaries one Muon group's step may hold); the ``single`` section then adds a row with no
cap (``step_memory_mb=None``).

Usage::

    python benchmarks/bench_memory.py                       # every section, 4-9 min on 2 cores (by their load)
    python benchmarks/bench_memory.py --quick               # tiny sizes (smoke test, seconds)
    python benchmarks/bench_memory.py --sections single fsdp --step-memory-mb 64
    python benchmarks/bench_memory.py --device cuda --sections single callbacks   # one GPU
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from benchlib.harness import (
    check_device,
    describe_machine,
    dtype_name,
    machine_line,
    progress,
    table,
    target,
    targets_met,
    verdict,
    write_report,
)
from benchlib.ranks import RankSettings, char_batch, char_gpt, run_ranks
from benchlib.step_table import (
    ADAMW_BETAS,
    ADAMW_EPS,
    ADAMW_LR,
    LR,
    MOMENTUM,
    VOCAB,
    WEIGHT_DECAY,
    gpt_parameters,
    our_optimizer,
)
from torch import Tensor, nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_muon import Muon, MuonConfig, QKClip, UpdateSpectrumMonitor, route_parameters
from lightning_muon.hparams import OptimizerConfig
from lightning_muon.newton_schulz import resolve_ns_dtype
from lightning_muon_demo.models import CharGPT
from lightning_muon_demo.module import CharGPTModule

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_memory.json"
SECTIONS = ("single", "ddp", "fsdp", "mesh", "callbacks")
MULTI_RANK = {"ddp": 2, "fsdp": 2, "mesh": 4}  # ranks each multi-process section runs
MIB = 2**20

# Targets (benchmarks/README.md, "bench_memory.py").
TRANSIENT_RATIO_MAX = 1.25  # single: ours' transient <= 1.25 x torch.optim.Muon + AdamW's
STATE_RATIO_MAX = 0.51  # single: ours' state <= 0.51 x AdamW's (one buffer per matrix, not two)
FSDP_PEAK_RATIO_MAX = 1.0  # fsdp: muon_fsdp's peak <= FSDP2 + AdamW's, on every rank

QK_CLIP_THRESHOLD = 1e-3  # under the logits at initialization: heads are clipped, the clip's work runs

# ---------------------------------------------------------------- the knob


def knob_exists() -> bool:
    """Whether ``Muon`` takes ``step_memory_mb`` (the most MiB of temporaries one Muon step may hold)."""
    return "step_memory_mb" in OptimizerConfig.keywords()


def knob_default() -> Any:
    return OptimizerConfig.keywords().get("step_memory_mb")


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


def our_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """``Muon``'s keywords from the flags: ``step_memory_mb`` where it was given and ``Muon`` takes it."""
    if cfg["step_memory_given"] and knob_exists():
        return {"step_memory_mb": cfg["step_memory_mb"]}
    return {}


def knob_label(cfg: dict[str, Any]) -> str:
    if not knob_exists():
        return ""
    value = cfg["step_memory_mb"] if cfg["step_memory_given"] else knob_default()
    return f"step_memory_mb={value}" + ("" if cfg["step_memory_given"] else ", the default")


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
    innermost outside the tracker) and the operator that allocated.
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
            if fallback is None and "_tools" not in path and "_python_dispatch" not in path and path != __file__:
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


# ---------------------------------------------------------------- single: one process, GPT-like parameters


def _torch_adamw(params: list[Tensor], foreach: bool = True) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=ADAMW_LR, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0, foreach=foreach)


def _single_variants(cfg: dict[str, Any], auto: str) -> dict[str, tuple[str, str, Callable]]:
    """key -> (label, Newton-Schulz dtype shown, build(hidden, other) -> optimizers)."""
    ours = our_kwargs(cfg)
    label = knob_label(cfg)
    variants: dict[str, tuple[str, str, Callable]] = {
        "ours": (
            f"ours{f' ({label})' if label else ''}",
            auto,
            lambda h, o: [our_optimizer(h, o, "polar_express", None, **ours)],
        ),
    }
    if knob_exists():
        variants["ours_unbounded"] = (
            "ours, unbounded (step_memory_mb=None)",
            auto,
            lambda h, o: [our_optimizer(h, o, "polar_express", None, step_memory_mb=None)],
        )
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
        return [muon, _torch_adamw(o)]

    variants["torch"] = ("torch.optim.Muon + AdamW", "bfloat16 (always)", torch_reference)
    variants["adamw"] = ("torch.optim.AdamW", "-", lambda h, o: [_torch_adamw(h + o)])
    return variants


def bench_single(cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(cfg["device"])
    d, layers = cfg["single_model"]
    auto = dtype_name(resolve_ns_dtype(None, device, torch.float32))
    rows = []
    for key, (label, ns_dtype, build) in _single_variants(cfg, auto).items():
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


def print_single(section: dict[str, Any], cfg: dict[str, Any]) -> None:
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
    _print_sites([(r["optimizer"], r) for r in rows])
    _print_targets(section["targets"])


def _print_sites(rows: list[tuple[str, dict[str, Any]]]) -> None:
    sites = [(label, r["peak_at"]) for label, r in rows if r.get("peak_at")]
    if sites:
        print("peak reached at (innermost frame of lightning_muon or torch.optim, and the allocating op):")
        for label, site in sites:
            print(f"  {label}: {site}")


# ---------------------------------------------------------------- ddp, fsdp: W ranks, CharGPT


def _rank_settings(cfg: dict[str, Any], world: int) -> RankSettings:
    m = cfg["dist_model"]
    return RankSettings(
        quick=cfg["quick"],
        world_size=world,
        threads=cfg["threads"],
        n_layer=m["n_layer"],
        n_embd=m["n_embd"],
        n_head=m["n_head"],
        block_size=m["block_size"],
        batch=m["batch"],
        warmup=1,
        steps=1,
        device=cfg["device"],
    )


def _rank_device(cfg: dict[str, Any]) -> torch.device:
    # run_ranks set this rank's GPU as the current one: "cuda" means it.
    return torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")


def _our_optimizer(model: nn.Module, cfg: dict[str, Any]) -> Muon:
    return Muon(route_parameters(model), lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, **our_kwargs(cfg))


def _muon_param_bytes(opt: Muon, device: torch.device) -> int:
    matrices = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    return sum(storages(matrices, device).values())


def _train_and_measure(
    model: nn.Module,
    step: Callable[[], Any],
    meter: StepMeter,
    zero_grad: Callable[[], Any],
    s: RankSettings,
    rank: int,
) -> dict[str, Any]:
    """Two training steps on this rank's batches; the second optimizer step is measured."""
    for i in range(2):
        zero_grad()
        x, y = char_batch(s, i, rank * s.batch, (rank + 1) * s.batch)
        CharGPT.loss(model(x), y).backward()
        if i == 0:
            step()
    return measure(step, meter)


DDP_CONFIGS = {
    "adamw": "DDP + AdamW",
    "muon_replicated": "DDP + Muon, replicated",
    "muon_ddp": "muon_ddp",
}


def _ddp_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_muon.distributed.sharded import MuonSharding

    s, device = _rank_settings(cfg, world), _rank_device(cfg)
    out = {}
    for name in DDP_CONFIGS:
        model = char_gpt(s)
        sharding = None
        if name == "adamw":
            opt: torch.optim.Optimizer = _torch_adamw(list(model.parameters()))
        else:
            opt = _our_optimizer(model, cfg)
        if name == "muon_ddp":
            # As MuonDDPStrategy(overlap=False) sets it up: DDP ignores the Muon matrices, whose
            # gradients reduce_gradients() sends to their owners inside the measured step.
            sharding = MuonSharding(opt, mode="reduce_scatter")
            ids = {id(p) for p in sharding.params}
            names = [n for n, p in model.named_parameters() if id(p) in ids]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
            for p in sharding.params:  # DDP does not broadcast what it ignores
                dist.broadcast(p.data, src=0)
        ddp = DistributedDataParallel(model)

        def step(opt: torch.optim.Optimizer = opt, sharding: Any = sharding) -> None:
            if sharding is not None:
                sharding.reduce_gradients()
            opt.step()

        kept = (lambda sh=sharding: list(getattr(sh, "_buffers", {}).values())) if sharding is not None else list
        meter = StepMeter(device, list(model.parameters()), [opt], kept)
        row = _train_and_measure(ddp, step, meter, lambda opt=opt: opt.zero_grad(set_to_none=True), s, rank)
        if isinstance(opt, Muon):
            row["muon_param_bytes"] = _muon_param_bytes(opt, device)
        out[name] = row
        del ddp, model, opt, sharding, step, meter
    return out


FSDP_CONFIGS = {
    "adamw": "FSDP2 + AdamW (foreach)",
    "adamw_loop": "FSDP2 + AdamW (for-loop)",
    "owner": "muon_fsdp (owner)",
}


def _fsdp_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_muon.distributed.fsdp import MuonFSDPSharding

    s, device = _rank_settings(cfg, world), _rank_device(cfg)
    mesh = init_device_mesh(cfg["device"], (world,))
    out = {}
    for name in FSDP_CONFIGS:
        model = char_gpt(s)
        for block in model.blocks:  # what MuonFSDPStrategy's default sharding makes of CharGPT
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "owner":
            opt: torch.optim.Optimizer = _our_optimizer(model, cfg)
            MuonFSDPSharding(opt, mode="owner")
        else:
            opt = _torch_adamw(list(model.parameters()), foreach=name == "adamw")
        meter = StepMeter(device, list(model.parameters()), [opt])
        row = _train_and_measure(model, opt.step, meter, lambda opt=opt: opt.zero_grad(set_to_none=True), s, rank)
        if isinstance(opt, Muon):
            row["muon_param_bytes"] = _muon_param_bytes(opt, device)
        out[name] = row
        del model, opt, meter
    return out


# ---------------------------------------------------------------- mesh: 2 x 2 (data x tensor)


MESH_CONFIGS = {
    "adamw": "FSDP2 + TP + AdamW",
    "duplicated": "Muon, tp_mode=duplicated",
    "distributed": "Muon, tp_mode=distributed",
    "blockwise": "Muon, tp_mode=blockwise",
}


def _mesh_model(d: int, blocks: int, mesh: Any, device: str) -> nn.Module:
    """bench_tp.py's stack of blocks, placed as Lightning's ModelParallelStrategy places it."""
    from bench_tp import build_model

    return build_model(d, blocks, mesh, device)


def _mesh_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_muon.distributed.tensor_parallel import DP_DIM, TP_DIM, MuonTPSharding

    device = _rank_device(cfg)
    d, blocks = cfg["mesh_model"]
    mesh = init_device_mesh(cfg["device"], (2, 2), mesh_dim_names=(DP_DIM, TP_DIM))
    out = {}
    for name in MESH_CONFIGS:
        model = _mesh_model(d, blocks, mesh, cfg["device"])
        params = list(model.parameters())
        if name == "adamw":
            opt: torch.optim.Optimizer = _torch_adamw(params)
        else:
            opt = Muon(params, lr=LR, weight_decay=WEIGHT_DECAY, tp_mode=name, **our_kwargs(cfg))
            MuonTPSharding(opt, tp_mode=name)
        for i in range(2):
            torch.manual_seed(i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DTensor's notice on random ops over a CPU mesh
                for p in params:
                    p.grad = torch.randn_like(p)
            if i == 0:
                opt.step()
        out[name] = measure(opt.step, StepMeter(device, params, [opt]))
        del model, params, opt
    return out


# ---------------------------------------------------------------- summaries of the multi-rank sections


def _rank_rows(ranks: list[dict[str, Any]], configs: dict[str, str], ref: str) -> list[dict[str, Any]]:
    rows = []
    for r, rank in enumerate(ranks):
        for key, label in configs.items():
            row = {"config": key, "label": label, "rank": r, **rank[key]}
            row["peak_per_ref"] = row["peak_bytes"] / rank[ref]["peak_bytes"]
            row["state_per_ref"] = row["state_bytes"] / rank[ref]["state_bytes"]
            rows.append(row)
    return rows


def _print_rank_table(title: str, note: str, rows: list[dict[str, Any]], ref_label: str) -> None:
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
    _print_sites([(f"{r['label']}, rank 0", r) for r in rows if r["rank"] == 0])


def bench_ddp(cfg: dict[str, Any]) -> dict[str, Any]:
    world = MULTI_RANK["ddp"]
    ranks = run_ranks(_ddp_rank, world, cfg, backend=_backend(cfg), threads=cfg["threads"])
    return {"world_size": world, "model": cfg["dist_model"], "rows": _rank_rows(ranks, DDP_CONFIGS, "adamw")}


def bench_fsdp(cfg: dict[str, Any]) -> dict[str, Any]:
    world = MULTI_RANK["fsdp"]
    ranks = run_ranks(_fsdp_rank, world, cfg, backend=_backend(cfg), threads=cfg["threads"])
    rows = _rank_rows(ranks, FSDP_CONFIGS, "adamw")
    worst = max(r["peak_per_ref"] for r in rows if r["config"] == "owner")
    targets = [
        target("fsdp: muon_fsdp's peak / FSDP2 + AdamW (foreach)'s, worst rank", worst, "<=", FSDP_PEAK_RATIO_MAX)
    ]
    return {"world_size": world, "model": cfg["dist_model"], "rows": rows, "targets": targets}


def bench_mesh(cfg: dict[str, Any]) -> dict[str, Any]:
    world = MULTI_RANK["mesh"]
    ranks = run_ranks(_mesh_rank, world, cfg, backend=_backend(cfg), threads=cfg["threads"])
    return {
        "world_size": world,
        "mesh": [2, 2],
        "model": cfg["mesh_model"],
        "rows": _rank_rows(ranks, MESH_CONFIGS, "adamw"),
    }


def _backend(cfg: dict[str, Any]) -> str:
    return "nccl" if cfg["device"] == "cuda" else "gloo"


def _dist_line(cfg: dict[str, Any]) -> str:
    m = cfg["dist_model"]
    model = f"CharGPT d={m['n_embd']} x {m['n_layer']} layers ({m['n_head']} heads)"
    return f"{model}, batch {m['batch']} x {m['block_size']} per rank"


def print_ddp(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    title = f"\n== ddp: {section['world_size']} {_backend(cfg)} ranks, {_dist_line(cfg)}; per rank, second step() =="
    note = (
        "muon_ddp: MuonSharding(reduce_scatter) with DDP ignoring the Muon matrices, as\n"
        "MuonDDPStrategy(overlap=False): its step is reduce_gradients() + step(), the all-to-all of Muon\n"
        "gradients included; kept = its flat send/receive buffers. DDP's own gradient buckets (untouched by\n"
        "the step) are not counted."
    )
    _print_rank_table(title, note, section["rows"], "DDP + AdamW")


def print_fsdp(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    ranks = f"{section['world_size']} {_backend(cfg)} ranks"
    title = f"\n== fsdp: FSDP2 on {ranks}, {_dist_line(cfg)}; per rank, second step() =="
    note = (
        "fully_shard per block, then the root, as MuonFSDPStrategy does; params, grads and state are this rank's\n"
        "shards; muon_fsdp = Muon + MuonFSDPSharding(mode='owner'): owners gather whole matrices in the step"
    )
    _print_rank_table(title, note, section["rows"], "FSDP2 + AdamW (foreach)")
    _print_targets(section["targets"])


def print_mesh(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    d, blocks = section["model"]
    title = (
        f"\n== mesh: 2 x 2 (data x tensor) {_backend(cfg)} ranks, {blocks} blocks of d={d} (bench_tp.py's: q,k,v,fc1 "
        "colwise, proj,fc2 rowwise); per rank, second step() =="
    )
    note = "random gradients; every parameter a matrix (no biases), so Muon's state is half of AdamW's"
    _print_rank_table(title, note, section["rows"], "AdamW")


# ---------------------------------------------------------------- callbacks: a Lightning fit


class StepProbe(pl.Callback):
    """Measures one optimizer step of a fit: from ``on_before_optimizer_step`` (gradients ready) to the end of
    ``on_train_batch_end`` (list it after the callbacks it measures)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.meter: StepMeter | None = None
        self.result: dict[str, Any] | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.at_step or self.meter is not None:
            return
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self.meter = StepMeter(pl_module.device, params, list(trainer.optimizers))
        self.meter.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.meter is not None and self.result is None:
            self.result = self.meter.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.meter is not None and self.result is None:
            self.result = self.meter.stop()  # leaves the tracker's dispatch mode


CALLBACK_CONFIGS = {
    "none": "no callbacks",
    "monitor": "UpdateSpectrumMonitor",
    "qk_clip": "QKClip",
    "both": "UpdateSpectrumMonitor + QKClip",
}


def _callbacks_fit(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    m, device = cfg["callbacks_model"], torch.device(cfg["device"])
    pl.seed_everything(0, verbose=False)
    config = MuonConfig(lr=LR, weight_decay=WEIGHT_DECAY, adamw_lr=ADAMW_LR, **our_kwargs(cfg))
    module = CharGPTModule(
        n_layer=m["n_layer"], n_head=m["n_head"], n_embd=m["n_embd"], block_size=m["block_size"], muon_config=config
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (2 * m["batch"], m["block_size"] + 1), generator=gen)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=m["batch"]
    )
    monitor = UpdateSpectrumMonitor(every_n_steps=1) if name in ("monitor", "both") else None
    clip = QKClip(threshold=QK_CLIP_THRESHOLD) if name in ("qk_clip", "both") else None
    callbacks: list[pl.Callback] = [c for c in (monitor, clip) if c is not None]
    probe = StepProbe(at_step=1)
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=2,
        logger=False,
        callbacks=[*callbacks, probe],  # the probe last: its batch end comes after theirs
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,  # QKClip's exact maxima on every step, as on a logged one
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no logger, small data, few steps
        trainer.fit(module, data)
    if probe.result is None:
        raise RuntimeError(f"callbacks {name}: the second optimizer step was not measured")
    # What the callbacks did in the fit's two steps: spectra logged, heads clipped (H per layer and step).
    return {
        **probe.result,
        "monitor_logged_steps": monitor.logged_steps if monitor is not None else 0,
        "qk_clip_clipped_heads": clip.clipped_heads_total if clip is not None else 0,
    }


def bench_callbacks(cfg: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for key, label in CALLBACK_CONFIGS.items():
        row = _callbacks_fit(key, cfg)
        progress(f"callbacks: {label}: peak {mib(row['peak_bytes']):.1f} MiB")
        rows.append({"config": key, "label": label, **row})
    base = rows[0]
    for row in rows:
        row["transient_over_none_bytes"] = row["transient_bytes"] - base["transient_bytes"]
        row["peak_per_none"] = row["peak_bytes"] / base["peak_bytes"]
    return {"model": cfg["callbacks_model"], "qk_clip_threshold": QK_CLIP_THRESHOLD, "rows": rows}


def print_callbacks(section: dict[str, Any], cfg: dict[str, Any]) -> None:
    m = section["model"]
    clipped = max(r["qk_clip_clipped_heads"] for r in section["rows"])
    print(
        f"\n== callbacks: one process, a Lightning fit of CharGPT d={m['n_embd']} x {m['n_layer']} "
        f"({m['n_head']} heads), batch {m['batch']} x {m['block_size']}; the second optimizer step =="
    )
    rows = [
        [
            r["label"],
            mib(r["params_bytes"]),
            mib(r["grads_bytes"]),
            mib(r["state_bytes"]),
            mib(r["peak_bytes"]),
            mib(r["transient_bytes"]),
            mib(r["transient_over_none_bytes"]),
            r["peak_per_none"],
        ]
        for r in section["rows"]
    ]
    headers = ["callbacks", "params MiB", "grads MiB", "state MiB", "peak MiB", "transient MiB"]
    headers += ["transient - none's MiB", "peak / none's"]
    print(table(headers, rows))
    print(
        "measured from on_before_optimizer_step to the end of on_train_batch_end (the callbacks' post-step work):\n"
        f"UpdateSpectrumMonitor(every_n_steps=1) observes every update (an update hook: the Nesterov update is then\n"
        f"not donated to Newton-Schulz); QKClip(threshold={section['qk_clip_threshold']}) clipped "
        f"{clipped} of {m['n_layer'] * m['n_head'] * 2} heads over the fit's 2 steps"
    )
    _print_sites([(r["label"], r) for r in section["rows"]])


def _print_targets(targets: list[dict[str, Any]]) -> None:
    for t in targets:
        print(f"target {t['name']}: {t['value']:.3f} {t['op']} {t['bound']} {verdict(t['passed'])}")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default; gloo ranks) or cuda (NCCL, rank r on cuda:r)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (d=64 x 2): a smoke test, seconds")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which sections (default: all)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank of the multi-rank sections")
    parser.add_argument(
        "--step-memory-mb",
        type=step_memory_arg,
        default=argparse.SUPPRESS,
        help="Muon's step_memory_mb (MiB of temporaries one Muon step may hold; 'auto' or 'none' also taken), "
        "passed where Muon takes it (default: the library's)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    args.step_memory_given = hasattr(args, "step_memory_mb")
    if not args.step_memory_given:
        args.step_memory_mb = None
    if args.threads < 1:
        parser.error("--threads must be positive")
    args.sections = [s for s in SECTIONS if s in args.sections]  # in the order they run, once each
    check_device(parser, args)
    if args.device == "cuda":
        need = {s: MULTI_RANK[s] for s in args.sections if s in MULTI_RANK}
        if need and max(need.values()) > torch.cuda.device_count():
            named = ", ".join(f"{s} runs {n}" for s, n in need.items())
            parser.error(
                f"--device cuda needs one GPU per rank (NCCL): {named}, but torch.cuda.device_count() is "
                f"{torch.cuda.device_count()}; on fewer GPUs pass --sections single callbacks"
            )
    return args


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        dist_model = dict(n_embd=64, n_layer=2, n_head=2, block_size=16, batch=2)
        single, mesh, callbacks = (64, 2), (64, 2), dict(n_embd=64, n_layer=2, n_head=2, block_size=16, batch=2)
    else:
        dist_model = dict(n_embd=768, n_layer=2, n_head=12, block_size=64, batch=2)
        single, mesh, callbacks = (768, 12), (768, 2), dict(n_embd=768, n_layer=2, n_head=12, block_size=64, batch=4)
    return {
        "quick": args.quick,
        "device": args.device,
        "sections": args.sections,
        "threads": args.threads,
        "single_model": single,
        "dist_model": dist_model,
        "mesh_model": mesh,
        "callbacks_model": callbacks,
        "step_memory_given": args.step_memory_given,
        "step_memory_mb": args.step_memory_mb,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = settings_from_args(args)
    machine = describe_machine(args.device)
    run = "quick" if args.quick else "full"
    print(f"lightning_muon: memory per rank of an optimizer step ({run}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"machine: {machine_line(machine)}")
    how = "MemTracker (torch.distributed._tools)" if args.device == "cpu" else "torch.cuda.max_memory_allocated"
    print(f"peak measured with {how}; MiB = 2^20 bytes")
    if knob_exists():
        print(f"Muon's step_memory_mb: {knob_label(cfg)}")
    elif args.step_memory_given:
        print("--step-memory-mb ignored: this Muon has no step_memory_mb")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # routing reports, tips
    start = time.perf_counter()
    sections: dict[str, Any] = {}
    runs = {
        "single": (bench_single, print_single),
        "ddp": (bench_ddp, print_ddp),
        "fsdp": (bench_fsdp, print_fsdp),
        "mesh": (bench_mesh, print_mesh),
        "callbacks": (bench_callbacks, print_callbacks),
    }
    for name in cfg["sections"]:
        measure_section, print_section = runs[name]
        t0 = time.perf_counter()
        sections[name] = measure_section(cfg)
        sections[name]["elapsed_s"] = time.perf_counter() - t0
        print_section(sections[name], cfg)
    targets = [t for s in sections.values() for t in s.get("targets", [])]
    elapsed = time.perf_counter() - start
    print(f"\ntargets met: {sum(t['passed'] for t in targets)} of {len(targets)}; total {elapsed:.1f} s")
    report = {
        "machine": machine,
        "settings": {**cfg, "step_memory_knob": knob_exists(), "step_memory_default": knob_default()},
        "sections": sections,
        "targets": targets,
        **targets_met(targets),
        "elapsed_s": elapsed,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
