"""benchmarks/benchlib/scale_memory.py: its per-rank byte counts, and its peak against bench_fsdp.py --memory's."""

from __future__ import annotations

import torch
from benchlib import scale_memory as smem
from benchlib.ranks import VOCAB

from lightning_muon_demo.models import CharGPT

FP32_BF16_NS = smem.Dtypes(torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16)

# One run of `python benchmarks/bench_memory.py --sections fsdp` (now `bench_fsdp.py --memory`), 2026-11-26
# (CPU, 2 gloo ranks, torch 2.13.0+cpu, fast bf16 matmul: yes, so Newton-Schulz in bf16;
# step_memory_mb="auto" = 32 MiB on CPU). CharGPT d=768 x 2 layers, vocab 256, block 64, fp32.
# Bytes per rank, from the JSON's sections.fsdp.rows.
MEASURED_PARAMS = 29_239_296  # both configs, both ranks
MEASURED_GRADS = 29_239_296
MEASURED_MUON_FSDP_STATE = 30_167_124  # counters included (21 AdamW tensors x 4 B)
MEASURED_MUON_FSDP_PEAK = (139_370_580, 133_472_344)  # ranks 0, 1
MEASURED_ADAMW_STATE = 58_478_708
MEASURED_ADAMW_PEAK = 146_196_596  # FSDP2 + AdamW (foreach), both ranks
CPU_CAP = int(smem.AUTO_STEP_MEMORY_MB["cpu"] * 2**20)


def test_terms_are_exact_byte_counts_for_a_tiny_model() -> None:
    # Odd row counts: the worst rank of 2 holds ceil(rows / 2) rows (torch.chunk blocks).
    tiny = smem.MemoryModel("tiny", matrices=((5, 4), (3, 4)), others=((7,), (6, 2)))
    assert smem.shard_numel((5, 4), 2) == 12 and smem.shard_numel((7,), 2) == 4
    # Worst-rank shards: matrices 3*4 + 2*4 = 20 elements, others 4 + 3*2 = 10.
    ours = smem.muon_fsdp_memory(tiny, 2, smem.BF16_FP32_STATE, cap_bytes=1)
    assert ours["params"] == 30 * 2 and ours["grads"] == 30 * 2
    assert ours["state"] == 20 * 4 + 2 * 10 * 4 + 2 * 4  # momentum, two moments, two step counters
    # The (5, 4) matrix: update + result 20 * (2 + 2), iterate + two 4 x 4 Grams (20 + 32) * 2 = 184 bytes;
    # a unit of two is over the 1-byte cap, times the exchange factor; AdamW: one fp32 temporary.
    assert ours["muon_transient"] == int(smem.EXCHANGE_FACTOR * 2 * 184)
    assert ours["adamw_transient"] == 10 * 4
    assert ours["peak"] == ours["params"] + ours["grads"] + ours["state"] + ours["transient"]
    # A cap above the unit bounds the transient instead.
    assert smem.muon_fsdp_memory(tiny, 2, smem.BF16_FP32_STATE, cap_bytes=1000)["muon_transient"] == 1500
    ref = smem.fsdp_adamw_memory(tiny, 2, smem.BF16_FP32_STATE)
    assert (ref["params"], ref["grads"], ref["state"], ref["transient"]) == (60, 60, 2 * 30 * 4 + 4 * 4, 30 * 4)
    # The 8B layout counts Llama-3-8B's 8.03B parameters.
    assert smem.MODELS["8b"]().numel == 8_030_261_248


def test_char_gpt_shapes_are_the_routed_module() -> None:
    model = smem.from_module("tiny", CharGPT(VOCAB, 8, n_layer=2, n_head=2, n_embd=16))
    spec = smem.char_gpt_like(16, 2, VOCAB, 8)
    assert sorted(model.matrices) == sorted(spec.matrices)
    assert sorted(model.others) == sorted(spec.others)


def test_peak_bounds_the_measured_fsdp_peak() -> None:
    model = smem.char_gpt_like(768, 2, VOCAB, 64)
    ours = smem.muon_fsdp_memory(model, 2, FP32_BF16_NS, CPU_CAP)
    assert (ours["params"], ours["grads"], ours["state"]) == (MEASURED_PARAMS, MEASURED_GRADS, MEASURED_MUON_FSDP_STATE)
    worst = max(MEASURED_MUON_FSDP_PEAK)
    assert worst <= ours["peak"] <= 1.25 * worst, ours["peak"] / worst
    ref = smem.fsdp_adamw_memory(model, 2, FP32_BF16_NS)
    assert ref["state"] == MEASURED_ADAMW_STATE
    assert ref["peak"] == MEASURED_ADAMW_PEAK
