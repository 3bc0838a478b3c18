"""Every optimizer of NVIDIA Emerging-Optimizers 0.3.0 next to ours, on the same gradients: the parity table.

Run by hand, outside the test suite (Emerging-Optimizers needs Python >= 3.12 and is not a
dependency)::

    pip download --no-deps --python-version 3.12 --only-binary=:all: emerging-optimizers==0.3.0 -d /tmp/eo
    (cd /tmp/eo && unzip -q -o emerging_optimizers-0.3.0-py3-none-any.whl)
    pip install absl-py
    python studies/eo_side_by_side.py --eo /tmp/eo

On Python 3.11 the wheel imports after two shims, applied here: ``typing.override`` (new in
3.12) as the identity, and an empty ``emerging_optimizers.triton_kernels`` module (Triton
kernels for CUDA only). Every case runs 10 steps at fp32 on four weight shapes (64x32,
48x64, 64x64, 96x64; LaProp also on a 64-vector) from the same start and the same
gradients, each side given the same keywords, Emerging-Optimizers' own names (ours reads them
through ``lightning_muon.aliases``), with ``fp32_matmul_prec="highest"`` (float32 Newton-Schulz
on both sides, whatever the host's automatic dtype), and prints per shape the worst relative
difference over the steps, ``||W_ours - W_eo||_F / ||W_eo||_F``. Each row names the keys both sides were given.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The benchmarks' machine line and device check (benchmarks/benchlib/harness.py): one way to say where a number ran.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchlib.harness import check_device, describe_machine, machine_line

SHAPES = [(64, 32), (48, 64), (64, 64), (96, 64)]
STEPS = 10
TARGET = 1e-5


@dataclass
class Case:
    """One row: Emerging-Optimizers' registry name and keywords, and our group's algorithm and keys."""

    label: str
    eo_name: str
    eo_kwargs: dict[str, Any]
    ours: str
    our_keys: dict[str, Any]
    shapes: list[tuple[int, ...]] = field(default_factory=lambda: list(SHAPES))
    init: Callable[[torch.Tensor], torch.Tensor] | None = None  # the starting weight, from a random one


# Emerging-Optimizers' ``Muon`` defaults where our ``muon`` group's differ (ours: Nesterov, Polar Express, ...).
EO_MUON = dict(
    momentum=0.95, weight_decay=0.01, nesterov=False, coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral"
)


def _muon_keys(eo: dict[str, Any]) -> dict[str, Any]:
    """Our ``muon`` group keys for Emerging-Optimizers' ``Muon`` keywords: its own names (``aliases``), its defaults
    where ours differ, and the standard iteration (ours may pick Gram's where it is faster)."""
    return {**EO_MUON, **eo, "ns_method": "standard"}


def _sinkhorn_init(w: torch.Tensor) -> torch.Tensor:
    from lightning_muon.algorithms.sinkhorn_muon import sinkhorn_knopp

    return sinkhorn_knopp(w, 20, 1e-8)


def cases() -> list[Case]:
    """The table's rows: every optimizer Emerging-Optimizers 0.3.0 registers that we have."""
    lr, base = 0.02, dict(fp32_matmul_prec="highest")
    out = []
    for coefficient_type in ("quintic", "polar_express", "simple"):
        eo = dict(
            base, lr=lr, coefficient_type=coefficient_type, num_ns_steps=8 if coefficient_type == "polar_express" else 5
        )
        out.append(Case(f"muon {coefficient_type}", "muon", eo, "muon", _muon_keys(eo)))
    for scale_mode, nesterov in (("shape_scaling", True), ("unit_rms_norm", False)):
        eo = dict(base, lr=lr, scale_mode=scale_mode, nesterov=nesterov)
        out.append(Case(f"muon {scale_mode} nesterov={nesterov}", "muon", eo, "muon", _muon_keys(eo)))
    for method in ("adamuon", "normuon", "namo"):
        eo = dict(base, lr=lr, momentum=0.95, weight_decay=0.01, moment2_method=method, beta2=0.95, eps=1e-8)
        ours = _muon_keys(eo)
        out.append(Case(f"adaptive_muon {method}", "adaptive_muon", eo, "adaptive_muon", ours))
        out.append(
            Case(
                f"  as muon second_moment={method!r}",
                "adaptive_muon",
                eo,
                "muon",
                dict(
                    {k: v for k, v in _muon_keys(eo).items() if k not in ("moment2_method", "beta2", "eps")},
                    second_moment=method,
                    second_moment_beta2=0.95,
                    second_moment_eps=1e-8,
                ),
            )
        )
    eo = dict(base, lr=lr, hyperball_radius=None)
    out.append(Case("muon_hyperball", "muon_hyperball", eo, "muon_hyperball", dict(_muon_keys(eo))))
    out += [
        Case("scion", "scion", dict(base, lr=lr), "scion", dict(base, lr=lr)),
        Case(
            "scion polar_express r=2",
            "scion",
            dict(base, lr=lr, coefficient_type="polar_express", num_ns_steps=8, spectral_radius=2.0),
            "scion",
            dict(base, lr=lr, coefficient_type="polar_express", num_ns_steps=8, spectral_radius=2.0),
        ),
        Case("polargrad", "polargrad", dict(base, lr=1e-4), "polargrad", dict(base, lr=1e-4)),
        Case(
            "polargrad nesterov l2",
            "polargrad",
            dict(base, lr=1e-4, nesterov=True, weight_decay_method="l2"),
            "polargrad",
            dict(base, lr=1e-4, nesterov=True, weight_decay_method="l2"),
        ),
        Case("mop nuclear_norm", "mop", dict(base, lr=1e-4), "mop", dict(base, lr=1e-4)),
        Case(
            "mop spectral",
            "mop",
            dict(base, lr=lr, scale_mode="spectral"),
            "mop",
            dict(base, lr=lr, scale_mode="spectral"),
        ),
        Case("spel", "spel", dict(base, lr=lr), "spel", dict(base, lr=lr)),
        Case(
            "sinkhorn_muon",
            "sinkhorn_muon",
            dict(base, lr=1e-3),
            "sinkhorn_muon",
            dict(base, lr=1e-3),
            init=_sinkhorn_init,
        ),
        Case("laprop", "laprop", dict(lr=1e-3), "laprop", dict(lr=1e-3), shapes=[*SHAPES, (64,)]),
        Case(
            "laprop palm frob_normalize",
            "laprop",
            dict(lr=1e-3, weight_decay=0.1, weight_decay_method="palm", frob_normalize=True),
            "laprop",
            dict(lr=1e-3, weight_decay=0.1, weight_decay_method="palm", frob_normalize=True),
        ),
        Case("soap", "soap", dict(base, lr=3e-3, qr_fp32_matmul_prec="highest"), "soap", dict(lr=3e-3)),
        Case(
            "soap use_kl_shampoo",
            "soap",
            dict(base, lr=3e-3, qr_fp32_matmul_prec="highest", use_kl_shampoo=True),
            "soap",
            dict(lr=3e-3, use_kl_shampoo=True),
        ),
        Case(
            "soap use_eigh nesterov",
            "soap",
            dict(base, lr=3e-3, use_eigh=True, nesterov=True),
            "soap",
            dict(lr=3e-3, use_eigh=True, nesterov=True),
        ),
        Case("rekls", "rekls", dict(lr=3e-3), "rekls", dict(lr=3e-3)),
    ]
    return out


def load_emerging_optimizers(path: str | None) -> Any:
    """Import Emerging-Optimizers 0.3.0 (from ``path``, its unpacked wheel) with the two Python 3.11 shims."""
    if path is not None:
        sys.path.insert(0, path)
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # Python 3.12's decorator, a no-op at run time
    sys.modules.setdefault("emerging_optimizers.triton_kernels", types.ModuleType("emerging_optimizers.triton_kernels"))
    import emerging_optimizers.orthogonalized_optimizers
    import emerging_optimizers.scalar_optimizers
    import emerging_optimizers.soap  # noqa: F401
    from emerging_optimizers import registry

    return registry


def run_case(case: Case, registry: Any, device: str = "cpu") -> list[float]:
    """Per shape, the worst ``||W_ours - W_eo|| / ||W_eo||`` over the steps (NaN if a side raised)."""
    from lightning_muon import Muon

    out = []
    for k, shape in enumerate(case.shapes):
        gen = torch.Generator().manual_seed(1000 + k)
        w0 = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        if case.init is not None:
            w0 = case.init(w0)
        grads = [torch.randn(shape, generator=gen) for _ in range(STEPS)]
        theirs = torch.nn.Parameter(w0.to(device, copy=True))
        ours = torch.nn.Parameter(w0.to(device, copy=True))
        eo = registry.get_optimizer_cls(case.eo_name)([theirs], **case.eo_kwargs)
        opt = Muon([{"params": [ours], "algorithm": case.ours, **case.our_keys}])
        worst = 0.0
        for g in grads:
            theirs.grad, ours.grad = g.to(device, copy=True), g.to(device, copy=True)
            eo.step()
            opt.step()
            diff = torch.linalg.vector_norm(ours.detach() - theirs.detach())
            worst = max(worst, float(diff / torch.linalg.vector_norm(theirs.detach())))
        out.append(worst)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eo", default=None, help="folder of the unpacked emerging_optimizers 0.3.0 wheel")
    parser.add_argument("--only", default=None, help="run the rows whose label contains this")
    parser.add_argument("--device", default="cpu", help="where both sides run: cpu (default) or cuda")
    return check_device(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    registry = load_emerging_optimizers(args.eo)
    import emerging_optimizers

    print(
        f"# Emerging-Optimizers {getattr(emerging_optimizers, '__version__', '0.3.0')} vs lightning_muon, "
        f"fp32, {STEPS} steps, worst ||ours - theirs|| / ||theirs|| over the steps"
    )
    print(f"# machine: {machine_line(describe_machine(args.device))}, Python {platform.python_version()}")
    header = f"{'case':<36} " + " ".join(f"{'x'.join(map(str, s)):>9}" for s in SHAPES) + f" {'64':>9}  within 1e-5"
    print(header)
    failed = 0
    for case in cases():
        if args.only and args.only not in case.label:
            continue
        worst = run_case(case, registry, args.device)
        cells = [f"{w:9.1e}" for w in worst[: len(SHAPES)]]
        vector = f"{worst[len(SHAPES)]:9.1e}" if len(worst) > len(SHAPES) else f"{'':>9}"
        ok = all(w <= TARGET for w in worst)
        failed += not ok
        print(f"{case.label:<36} " + " ".join(cells) + f" {vector}  {'yes' if ok else 'NO'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
