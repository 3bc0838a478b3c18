"""Hardware profiles for ``scale_model.py``: the H100 SXM table with a source per number, and one measured here.

``h100_profile`` is datasheet figures plus two stated assumptions (how close Newton-Schulz
and training GEMMs come to peak). ``measure_profile`` replaces the rates with ones measured
on this machine's CPU or GPU (a large GEMM, ``orthogonalize`` on Newton-Schulz-sized
matrices, a copy); ``--set name=value`` on the command line changes any constant.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_muon.newton_schulz import ns_flops

# Every constant with where its number comes from. ``--set name=value`` changes any.
H100_SXM: dict[str, tuple[float, str]] = {
    "peak_tflops": (989.0, "NVIDIA H100 SXM5 datasheet: bf16 dense Tensor Core 989.4 TFLOP/s (1979 with sparsity)"),
    "ns_fraction": (
        0.5,
        "assumed, not measured (no GPU on the host that wrote this): Newton-Schulz's products have an inner size "
        "of 768-4096 and run below large-GEMM rates; --profile this-gpu measures orthogonalize on a GPU",
    ),
    "train_fraction": (
        0.75,
        "assumed, not measured: large bf16 cuBLAS GEMMs on H100 SXM run at roughly 70-80% of peak; real training "
        "MFU is lower, so the '% of step' column is an upper bound; --profile this-gpu measures an 8192^3 product",
    ),
    "intra_gbps": (450.0, "NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction per GPU (NVIDIA H100 datasheet)"),
    "inter_gbps": (50.0, "one 400 Gb/s NDR InfiniBand NIC per GPU (ConnectX-7, DGX H100) = 50 GB/s per direction"),
    "hbm_gbps": (3350.0, "NVIDIA H100 SXM5 datasheet: HBM3 3.35 TB/s"),
    "ranks_per_node": (8, "DGX/HGX H100: 8 GPUs per node"),
    "grad_bytes": (4, "fp32 master weights: DDP reduces gradients (and muon_ddp moves parameters) in fp32"),
    "wire_bytes_fsdp": (2, "muon_fsdp sends Newton-Schulz inputs and results in bf16 where Newton-Schulz runs in bf16"),
    "update_bytes": (
        20,
        "bytes of memory traffic per Muon element in the elementwise update: read grad, read+write momentum, "
        "read+write parameter, 4 B each (fp32)",
    ),
    "bucket_mb": (25.0, "torch DistributedDataParallel's default bucket_cap_mb"),
    "tokens_per_rank": (16384, "tokens per rank per optimizer step (micro-batch 16 x 1024); a flag sets it"),
}


@dataclass(frozen=True)
class Profile:
    """One hardware profile: rates, bandwidths and sizes, each with its source."""

    name: str
    values: dict[str, float]
    sources: dict[str, str]
    ns_dtype: torch.dtype = torch.bfloat16
    """The Newton-Schulz dtype there (it decides ``ns_method="auto"``)."""

    def __getattr__(self, key: str) -> float:
        try:
            return self.__dict__["values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def with_values(self, **changes: float) -> Profile:
        unknown = set(changes) - set(self.values)
        if unknown:
            raise ValueError(f"--set: unknown profile constant(s) {sorted(unknown)}; known: {sorted(self.values)}")
        sources = {**self.sources, **{k: f"set on the command line (was {self.values[k]})" for k in changes}}
        return replace(self, values={**self.values, **changes}, sources=sources)


def h100_profile() -> Profile:
    return Profile("H100 SXM", {k: v for k, (v, _) in H100_SXM.items()}, {k: s for k, (_, s) in H100_SXM.items()})


# ---------------------------------------------------------------- a profile measured here


def _best_seconds(fn: Any, device: str, reps: int = 3) -> float:
    fn()  # warm-up: allocation, kernel selection
    best = math.inf
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_profile(device: str = "cpu", ranks_per_node: int = 1) -> Profile:
    """Rates measured on this machine: a large GEMM, ``orthogonalize`` on Newton-Schulz-sized matrices, a copy.

    On CPU the "peak" is the large GEMM's measured rate (no datasheet to read), so the
    training fraction is 1. On CUDA the peak stays the H100 datasheet's and both fractions
    are measured. Link bandwidths are not measured (one host): CPU ranks talk through
    memory, so both link classes get the copy bandwidth; ``--set`` overrides them.
    """
    from lightning_muon.newton_schulz import orthogonalize, resolve_ns_dtype

    dtype = resolve_ns_dtype(None, device, torch.float32)
    cuda = device.startswith("cuda")
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    gemm = 2 * n**3 / _best_seconds(lambda: a @ a, device)
    sizes = [(768, 3072), (2048, 8192), (4096, 16384)] if cuda else [(256, 1024), (512, 2048)]
    ns_rates = {}
    for rows, cols in sizes:
        g = torch.randn(rows, cols, device=device)
        seconds = _best_seconds(lambda g=g: orthogonalize(g, steps=5, dtype=dtype), device)
        ns_rates[f"{rows}x{cols}"] = ns_flops(rows, cols, 5) / seconds
    x = torch.empty(64 * 1024**2 // 4, device=device)
    y = torch.empty_like(x)
    copy = 2 * x.numel() * 4 / _best_seconds(lambda: y.copy_(x), device)
    peak = H100_SXM["peak_tflops"][0] * 1e12 if cuda else gemm
    where = torch.cuda.get_device_name(device) if cuda else "this CPU"
    ns_best = max(ns_rates.values())
    values = {k: v for k, (v, _) in H100_SXM.items()}
    values.update(
        peak_tflops=peak / 1e12,
        ns_fraction=ns_best / peak,
        train_fraction=gemm / peak,
        hbm_gbps=copy / 1e9,
        ranks_per_node=ranks_per_node,
    )
    measured = ", ".join(f"{k}: {v / 1e9:.1f} GFLOP/s" for k, v in ns_rates.items())
    sources = {k: s for k, (_, s) in H100_SXM.items()}
    sources.update(
        peak_tflops=sources["peak_tflops"] if cuda else f"measured: {n}^3 {dtype} matmul on {where}",
        ns_fraction=f"measured on {where}: orthogonalize (5 steps, {dtype}) at {measured}; the best over the peak",
        train_fraction=f"measured on {where}: {n}^3 {dtype} matmul at {gemm / 1e9:.1f} GFLOP/s over the peak",
        hbm_gbps=f"measured on {where}: a 64 MiB copy (bytes read + written)",
        ranks_per_node="--ranks-per-node",
    )
    if not cuda:
        values.update(intra_gbps=copy / 1e9, inter_gbps=copy / 1e9)
        sources.update(
            intra_gbps="the measured copy bandwidth (ranks on one host share memory)",
            inter_gbps="as intra_gbps: one host has no inter-node link",
        )
    return Profile(f"measured on {where}", values, sources, ns_dtype=dtype)
