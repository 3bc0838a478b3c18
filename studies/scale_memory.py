"""Per-rank memory of one optimizer step under ``muon_fsdp``, against FSDP2 + AdamW, for ``scale_model.py``.

Per rank, in bytes: params + grads + optimizer state + the step's transient (peak = their
sum). Activations are not counted. Everything is sharded as ``fully_shard`` shards it: row
blocks of dim 0, the worst rank holding ``ceil(rows / W)`` rows of every tensor (the padded
shard). The parts:

- ``muon_fsdp``: params and grads in their dtypes, sharded; state: one momentum per hidden
  (Muon) matrix and two moments per AdamW tensor (embeddings, head, norms, biases) in the
  state dtype, sharded, plus AdamW's 4-byte step counter per tensor. Transient: the Muon step
  keeps a round's working set under the step memory cap (``lightning_muon.step_memory``):
  at most ``max(cap, 2 x matrix_working_bytes(largest matrix))`` (a unit of two matrices of
  the largest kind runs alone where it is larger than the cap), times ``EXCHANGE_FACTOR`` for
  the owner exchange (the owner also holds the whole matrices it received and the blob it
  sends back), plus the AdamW part's transient: one full-size temporary of this rank's AdamW
  shard in the state dtype (torch's foreach AdamW, ``_foreach_sqrt``).
- FSDP2 + AdamW: params and grads alike; state two moments per parameter (and the counters);
  transient one full-size temporary of the rank's whole shard in the state dtype.

``EXCHANGE_FACTOR`` is calibrated on ``bench_fsdp.py --memory`` (CharGPT d=768 x 2,
W = 2, fp32, CPU cap 32 MiB): see ``check_scale_model.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lightning_muon.layout import MatrixLayout
from lightning_muon.step_memory import AUTO_STEP_MEMORY_MB, matrix_working_bytes

# The owner's exchange on top of the round's working set (the received whole matrices and
# the send-back blob). Measured: 1.17 (bench_fsdp.py --memory, CharGPT d=768 x 2, W = 2, worst
# rank); 1.5 keeps the prediction an upper bound with margin (1.10 x the measured peak).
EXCHANGE_FACTOR = 1.5
COUNTER_BYTES = 4  # AdamW's step counter: a float32 scalar tensor per parameter
GPU_BYTES = 80 * 10**9  # "fits 80 GB": 80e9 bytes (74.5 GiB) of an H100 80GB's ~79 GiB
GIB = 2**30
GPU_CAP_BYTES = int(AUTO_STEP_MEMORY_MB["cuda"] * 2**20)  # step_memory_mb="auto" on a GPU


@dataclass(frozen=True)
class MemoryModel:
    """A model's parameter shapes: the hidden matrices (to Muon) and every other tensor (to AdamW)."""

    name: str
    matrices: tuple[tuple[int, ...], ...]
    others: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in (*self.matrices, *self.others))


@dataclass(frozen=True)
class Dtypes:
    """Parameters, gradients, optimizer state, and the Muon update / Newton-Schulz work (``matrix_working_bytes``)."""

    param: torch.dtype
    grad: torch.dtype
    state: torch.dtype
    update: torch.dtype
    work: torch.dtype


BF16_FP32_STATE = Dtypes(torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16)


def llama_like(name: str, d: int, layers: int, vocab: int, hidden: int, kv_heads: int, head_dim: int) -> MemoryModel:
    """GQA attention (q, k, v, o), SwiGLU MLP (gate, up, down), RMSNorms without bias, untied head."""
    kv = kv_heads * head_dim
    block = [(d, d), (kv, d), (kv, d), (d, d), (hidden, d), (hidden, d), (d, hidden)]
    others = [(vocab, d)] + [(d,), (d,)] * layers + [(d,), (vocab, d)]
    return MemoryModel(name, tuple(block * layers), tuple(others))


def char_gpt_like(d: int, layers: int, vocab: int, block_size: int) -> MemoryModel:
    """``lightning_muon_demo.models.CharGPT``, untied: qkv, proj, fc1, fc2 to Muon; the rest (embeddings,
    LayerNorms, biases, head) to AdamW."""
    block = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    per_layer = [(d,), (d,), (3 * d,), (d,), (d,), (d,), (4 * d,), (d,)]  # ln1, qkv.b, proj.b, ln2, fc1.b, fc2.b
    others = [(vocab, d), (block_size, d)] + per_layer * layers + [(d,), (d,), (vocab, d)]
    return MemoryModel(f"CharGPT d={d} x {layers}", tuple(block * layers), tuple(others))


def from_module(name: str, module: torch.nn.Module) -> MemoryModel:
    """``module``'s parameters as ``Muon`` routes them (``route_parameters``)."""
    from lightning_muon import Muon, route_parameters

    opt = Muon(route_parameters(module), lr=0.02)
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    ids = {id(p) for p in muon}
    others = [tuple(p.shape) for g in opt.param_groups for p in g["params"] if id(p) not in ids]
    return MemoryModel(name, tuple(tuple(p.shape) for p in muon), tuple(others))


MODELS = {
    # Llama-3-8B / 70B's shapes (vocab 128256, GQA with 8 KV heads of 128, SwiGLU, untied head).
    "8b": lambda: llama_like("8B (d=4096, 32 layers)", 4096, 32, 128256, 14336, 8, 128),
    "70b": lambda: llama_like("70B (d=8192, 80 layers)", 8192, 80, 128256, 28672, 8, 128),
}


def shard_numel(shape: Sequence[int], world: int) -> int:
    """Elements of the worst rank's ``Shard(0)`` block of ``shape`` (``torch.chunk``: ``ceil(rows / W)`` rows)."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def _shards(shapes: Iterable[Sequence[int]], world: int) -> int:
    return sum(shard_numel(s, world) for s in shapes)


def muon_fsdp_memory(
    model: MemoryModel,
    world: int,
    dtypes: Dtypes,
    cap_bytes: int | None,
    exchange_factor: float = EXCHANGE_FACTOR,
) -> dict[str, int]:
    """Bytes per rank (worst rank) of ``muon_fsdp``'s step: params, grads, state, transient, peak.

    ``cap_bytes``: the step memory cap (``step_memory_bytes``); None: no cap, every matrix's
    working set at once.
    """
    mats, others = _shards(model.matrices, world), _shards(model.others, world)
    s = dtypes.state.itemsize
    working = [matrix_working_bytes(m, MatrixLayout(), dtypes.update, dtypes.work) for m in model.matrices]
    if cap_bytes is None:
        rounds = sum(working)
    else:
        rounds = max(cap_bytes, 2 * max(working, default=0))
    muon_transient = int(exchange_factor * rounds)
    adamw_transient = others * s
    out = {
        "params": (mats + others) * dtypes.param.itemsize,
        "grads": (mats + others) * dtypes.grad.itemsize,
        "state": mats * s + 2 * others * s + COUNTER_BYTES * len(model.others),
        "muon_transient": muon_transient,
        "adamw_transient": adamw_transient,
        "transient": muon_transient + adamw_transient,
    }
    out["peak"] = out["params"] + out["grads"] + out["state"] + out["transient"]
    return out


def fsdp_adamw_memory(model: MemoryModel, world: int, dtypes: Dtypes) -> dict[str, int]:
    """Bytes per rank (worst rank) of FSDP2 + torch's foreach AdamW on every parameter."""
    shapes = (*model.matrices, *model.others)
    n, s = _shards(shapes, world), dtypes.state.itemsize
    out = {
        "params": n * dtypes.param.itemsize,
        "grads": n * dtypes.grad.itemsize,
        "state": 2 * n * s + COUNTER_BYTES * len(shapes),
        "transient": n * s,  # _foreach_sqrt(exp_avg_sq): one full-size temporary of the shard
    }
    out["peak"] = out["params"] + out["grads"] + out["state"] + out["transient"]
    return out


def memory_table(
    models: dict[str, MemoryModel],
    worlds: Sequence[int],
    dtypes: Dtypes = BF16_FP32_STATE,
    cap_bytes: int | None = GPU_CAP_BYTES,
    gpu_bytes: int = GPU_BYTES,
) -> dict:
    """Every model x W: ``muon_fsdp``'s parts and peak, FSDP2 + AdamW's peak, and whether each fits ``gpu_bytes``."""
    out: dict = {
        "assumptions": {
            "dtypes": {
                k: str(getattr(dtypes, k)).removeprefix("torch.") for k in ("param", "grad", "state", "update", "work")
            },
            "cap_bytes": cap_bytes,
            "exchange_factor": EXCHANGE_FACTOR,
            "gpu_bytes": gpu_bytes,
            "activations": "not counted",
        },
        "models": {},
    }
    for key, model in models.items():
        rows = {}
        for W in worlds:
            ours, ref = muon_fsdp_memory(model, W, dtypes, cap_bytes), fsdp_adamw_memory(model, W, dtypes)
            rows[W] = {
                "muon_fsdp": ours,
                "fsdp_adamw": ref,
                "muon_fsdp_fits": ours["peak"] <= gpu_bytes,
                "fsdp_adamw_fits": ref["peak"] <= gpu_bytes,
            }
        out["models"][key] = {"name": model.name, "params": model.numel, "worlds": rows}
    return out


def _first_fit(rows: dict, key: str) -> str:
    fits = [W for W, r in rows.items() if r[key]]
    if not fits:
        return "at no W listed"
    first = min(fits)
    return f"from W={first}" if all(r[key] for w, r in rows.items() if w >= first) else f"at W={fits}"


def print_memory_table(table: dict) -> None:
    a = table["assumptions"]
    cap = "no cap" if a["cap_bytes"] is None else f"{a['cap_bytes'] / 2**20:.0f} MiB"
    print(
        f"\n== memory per rank: muon_fsdp (owner) vs FSDP2 + AdamW (foreach); params {a['dtypes']['param']}, "
        f"grads {a['dtypes']['grad']}, state {a['dtypes']['state']}; step memory cap {cap}; GiB =="
    )
    print(
        f"{'model':<24} {'W':>5} {'params':>7} {'grads':>7} {'state':>7} {'transient':>9} {'peak':>7} "
        f"{'fits':>5} {'FSDP2+AdamW peak':>17} {'fits':>5}"
    )
    for res in table["models"].values():
        for W, r in res["worlds"].items():
            o, f = r["muon_fsdp"], r["fsdp_adamw"]
            print(
                f"{res['name']:<24} {W:>5} {o['params'] / GIB:>7.2f} {o['grads'] / GIB:>7.2f} {o['state'] / GIB:>7.2f} "
                f"{o['transient'] / GIB:>9.2f} {o['peak'] / GIB:>7.2f} {'yes' if r['muon_fsdp_fits'] else 'no':>5} "
                f"{f['peak'] / GIB:>17.2f} {'yes' if r['fsdp_adamw_fits'] else 'no':>5}"
            )
    gb = a["gpu_bytes"] / 1e9
    print(
        f"(activations not counted; fits = peak <= {gb:.0f} GB = {a['gpu_bytes'] / GIB:.1f} GiB; sharded as "
        f"fully_shard does, worst rank; muon_fsdp transient = {a['exchange_factor']} x max(cap, 2 matrices of the "
        "largest kind) + one temporary of the AdamW shard; FSDP2 + AdamW transient = one temporary of the whole shard)"
    )
    for res in table["models"].values():
        rows = res["worlds"]
        print(
            f"{res['name']}: fits an {gb:.0f} GB GPU with muon_fsdp {_first_fit(rows, 'muon_fsdp_fits')}, "
            f"with FSDP2 + AdamW {_first_fit(rows, 'fsdp_adamw_fits')}"
        )
