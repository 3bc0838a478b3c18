"""GPU readiness: bf16 Newton-Schulz, a step without host-device sync, 1-GPU fits under both strategies.

Marked ``cuda`` and skipped where ``torch.cuda.is_available()`` is False (CPU-only CI runs
the same code paths on CPU everywhere else in the suite).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from ddp_modules import TinyRegressor
from fabric_modules import one_process, train
from fsdp_modules import FSDPRegressor, trainer_kwargs
from torch import nn

from lightning_muon import AdamWSettings, Muon, MuonConfig, MuonSettings, orthogonalize
from lightning_muon.newton_schulz import FAST_BF16_ENV, resolve_ns_dtype

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFIG = MuonConfig(matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32"), scalar=AdamWSettings(lr=1e-2))


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_orthogonalize_in_bfloat16_on_cuda(monkeypatch):
    """Automatic dtype is bf16 on a GPU; singular values land in polar_express's band +- 4 u."""
    monkeypatch.delenv(FAST_BF16_ENV, raising=False)
    assert resolve_ns_dtype(None, "cuda", torch.float32) == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(256, 128, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(512, 128, dtype=torch.float64, generator=gen))
    s = torch.logspace(0, -2, 128, dtype=torch.float64)  # every relative value above 3e-3
    G = ((U * s) @ V.T).float().cuda()
    Q = orthogonalize(G)
    assert Q.dtype == torch.float32 and Q.device.type == "cuda"
    out = torch.diagonal(U.T @ Q.double().cpu() @ V)
    # polar_express maps relative singular values in [3e-3, 1] into [0.8589, 1.1411] (float64
    # evaluation of its composite polynomial); bf16 rounding adds at most a few u = 2^-8.
    u = 2.0**-8
    assert 0.8589 - 4 * u <= out.min().item() and out.max().item() <= 1.1411 + 4 * u


def _hybrid(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shapes = [(96, 32), (32, 32), (32, 128), (64, 32, 3, 3), (32,), (10, 32)]
    return [nn.Parameter((0.1 * torch.randn(shape, generator=gen)).to(device)) for shape in shapes]


def _grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)


def _optimizer(params: list[torch.Tensor], ns_dtype: str | None) -> Muon:
    groups = [
        {"params": params[:4], "algorithm": "muon"},
        {"params": params[4:], "algorithm": "adamw"},
    ]
    return Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, adamw_lr=1e-3, nonfinite="ignore")


def test_muon_step_on_cuda_never_syncs_with_the_host():
    """With nonfinite="ignore" a step queues GPU work only: set_sync_debug_mode("error") stays quiet."""
    params = _hybrid("cuda")
    opt = _optimizer(params, None)  # automatic: bf16 Newton-Schulz
    _grads(params, 2)
    opt.step()  # the first step creates the state
    _grads(params, 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(bool(p.isfinite().all()) for p in params)


def test_a_compiled_step_on_cuda_checks_gradients_without_a_sync_and_equals_eager():
    """Under torch.compile the default step (nonfinite="raise") has no graph break and no host sync: the check is
    decided on the GPU; a NaN gradient's step applies nothing and the next eager step raises naming it."""
    import torch._dynamo

    torch._dynamo.reset()
    eager_params, params = _hybrid("cuda"), _hybrid("cuda")
    opts = []
    for ps in (eager_params, params):
        groups = [{"params": ps[:4], "algorithm": "muon"}, {"params": ps[4:], "algorithm": "adamw"}]
        opts.append(Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype="float32", adamw_lr=1e-3))
    eager, opt = opts
    torch.backends.cuda.matmul.allow_tf32 = False
    for ps, o in ((eager_params, eager), (params, opt)):
        _grads(ps, 2)
        o.step()  # the first step makes the state (checked on the host)
    _grads(params, 3)
    explained = torch._dynamo.explain(opt.step)()
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]
    step = torch.compile(opt.step)
    for seed in (3, 4, 5):
        _grads(eager_params, seed)
        eager.step()
        _grads(params, seed)
        step()  # the first call compiles
    _grads(params, 6)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _grads(eager_params, 6)
    eager.step()
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in params]
    _grads(params, 7)
    params[1].grad[0, 0] = float("nan")
    step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    with pytest.raises(FloatingPointError, match="parameter 1 of shape \\(32, 32\\) in a compiled step"):
        opt.step()


def test_muon_step_on_cuda_equals_cpu_in_float32():
    """fp32 Newton-Schulz on GPU and CPU: the same update up to kernel rounding."""
    on_gpu, on_cpu = _hybrid("cuda"), _hybrid("cpu")
    opts = _optimizer(on_gpu, "float32"), _optimizer(on_cpu, "float32")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 keeps 10 bits)
    for t in range(3):
        for params, opt in zip((on_gpu, on_cpu), opts):
            _grads(params, 10 + t)
            opt.step()
    for a, b in zip(on_gpu, on_cpu):
        # Different blocking of the same fp32 sums (~1e-7 relative), which 3 Newton-Schulz
        # steps of slope <= ~1e3 keep below 1e-4.
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["muon_ddp", "muon_fsdp"])
def test_one_gpu_fit_under_each_strategy(tmp_path, strategy):
    """A 1-GPU Lightning fit (NCCL, world size 1) trains and keeps every parameter finite."""
    if strategy == "muon_ddp":
        model = TinyRegressor(CONFIG)
        kwargs = dict(max_steps=6, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
        kwargs.update(enable_model_summary=False, use_distributed_sampler=False)
    else:
        model = FSDPRegressor(CONFIG)
        kwargs = trainer_kwargs(tmp_path, 6, 1, 0.5, "bf16-mixed")
        kwargs.pop("accelerator")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-dataset notices
        trainer.fit(model)
    assert trainer.global_step == 6
    assert torch.distributed.get_backend() == "nccl"
    after = {n: p.detach() for n, p in model.named_parameters()}
    for name, p in after.items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert bool(full.isfinite().all()), name
        assert not torch.equal(full.cpu(), before[name].cpu()), name


@pytest.mark.parametrize(("strategy", "kind"), [("muon_ddp", "ddp"), ("muon_fsdp", "fsdp")])
def test_one_gpu_fabric_loop_under_each_strategy(strategy, kind):
    """Fabric's loop (accumulation, clipping) on one GPU under NCCL equals the same loop on the CPU."""
    import lightning as L

    spec = dict(kind=kind, steps=4, accumulate=2, clip=0.5, setup="separate")
    fabric = L.Fabric(accelerator="gpu", devices=1, strategy=strategy)
    fabric.launch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(fabric, spec)
    assert torch.distributed.get_backend() == "nccl"
    reference = one_process(spec)
    for name, expected in reference["params"].items():
        # fp32 on both; different blocking of the same sums (see test_muon_step_on_cuda_equals_cpu_in_float32).
        torch.testing.assert_close(result["params"][name], expected, rtol=1e-4, atol=1e-5)


def test_flex_attention_max_scores_equal_the_sdpa_drop_in_maxima():
    # The flex path reads the kernel's own row maxima; they must equal the second Q K^T's.
    from torch.nn.attention.flex_attention import create_block_mask

    from lightning_muon.attention import flex_attention, scaled_dot_product_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32, device="cuda", generator=gen) for _ in range(3))
    flex_module, sdpa_module = nn.Module(), nn.Module()
    for m in (flex_module, sdpa_module):
        m.qk_clip_recording = True
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 128, 128, device="cuda")
    out = flex_attention(q, k, v, block_mask=mask, module=flex_module)
    ref = scaled_dot_product_attention(q, k, v, is_causal=True, module=sdpa_module)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(flex_module.qk_clip_max_logits, sdpa_module.qk_clip_max_logits, rtol=1e-4, atol=1e-4)
