"""Spectral metrics and UpdateSpectrumMonitor: exact values on known spectra, loggers, checkpoints, ranks."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from spectra_modules import (
    CONFIG,
    EVERY,
    LR,
    TRAINER,
    OwnershipMonitor,
    SpectraRegressor,
    _rank_matrices,
    distributed_worker,
)
from torch import nn

from lightning_muon import Muon, MuonConfig, MuonSettings, UpdateSpectrumMonitor
from lightning_muon.callbacks._spectra import SpectrumCollector, render_heatmap
from lightning_muon.metrics import (
    EffectiveRank,
    LargestSingularValue,
    OrthogonalityError,
    RelativeUpdateRMS,
    SmallestKeptSingularValue,
    SpectrumMetrics,
    StableRank,
    UpdateRMS,
    effective_rank,
    gram_orthogonality_error,
    orthogonality_error,
    rms,
    singular_values,
    spectrum_stats,
)
from lightning_muon_demo.data import CharTextDataModule
from lightning_muon_demo.module import CharGPTModule

pytestmark = [pytest.mark.distributed, pytest.mark.policy_free]  # policy_free: see conftest.py

F64 = dict(rtol=1e-12, atol=1e-12)
# The spectra of a 2-rank run against one process: parameters agree to ~1e-6 (fp32 Newton-Schulz,
# only the gradient summation order differs), singular values of O to the same relative order.
RANKS = dict(rel=1e-4, abs=1e-6)


def _orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def _stats(matrix: torch.Tensor, rtol: float = 1e-3) -> dict[str, float]:
    return {k: float(v) for k, v in spectrum_stats(singular_values(matrix), rtol).items()}


def _entropy_rank(s: list[float]) -> float:
    p = [x / sum(s) for x in s if x > 0]
    return math.exp(-sum(x * math.log(x) for x in p))


# ---------------------------------------------------------------------- pure functions


def test_orthogonal_matrix_has_a_flat_spectrum():
    q = _orthogonal(6)
    stats = _stats(q)
    assert stats["sigma_max"] == pytest.approx(1.0, abs=1e-12)
    assert stats["sigma_min"] == pytest.approx(1.0, abs=1e-12)
    assert stats["stable_rank"] == pytest.approx(6.0, abs=1e-12)
    assert stats["effective_rank"] == pytest.approx(6.0, abs=1e-12)
    assert stats["orthogonality_error"] == pytest.approx(0.0, abs=1e-12)
    assert float(rms(q)) == pytest.approx(1 / math.sqrt(6), abs=1e-12)  # ||Q||_F^2 = 6 over 36 entries


@pytest.mark.parametrize("shape", [(8, 3), (3, 8)])
def test_semi_orthogonal_error_is_taken_on_the_short_side(shape):
    q = _orthogonal(8)[:, :3]  # orthonormal columns
    q = q if shape == (8, 3) else q.T
    stats = _stats(q)
    assert stats["orthogonality_error"] == pytest.approx(0.0, abs=1e-12)
    assert stats["stable_rank"] == pytest.approx(3.0, abs=1e-12)
    assert stats["effective_rank"] == pytest.approx(3.0, abs=1e-12)
    assert float(gram_orthogonality_error(q)) == pytest.approx(0.0, abs=1e-12)


def test_rank_one_matrix():
    u = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # |u| = 2
    v = torch.tensor([0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # |v| = 3
    a = torch.outer(u, v)  # (5, 7), one singular value 6, four zeros
    stats = _stats(a)
    assert stats["sigma_max"] == pytest.approx(6.0, abs=1e-12)
    assert stats["sigma_min"] == pytest.approx(6.0, abs=1e-12)  # the zeros are not kept
    assert stats["stable_rank"] == pytest.approx(1.0, abs=1e-12)
    assert stats["effective_rank"] == pytest.approx(1.0, abs=1e-12)
    assert stats["orthogonality_error"] == pytest.approx(math.sqrt((35.0**2 + 4 * 1.0) / 5), abs=1e-9)


def test_diagonal_matrix_every_quantity():
    a = torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.0], dtype=torch.float64))
    stats = _stats(a)
    assert stats["sigma_max"] == 3.0
    assert stats["sigma_min"] == 0.5
    assert stats["stable_rank"] == pytest.approx((9 + 1 + 0.25) / 9, abs=1e-12)
    assert stats["effective_rank"] == pytest.approx(_entropy_rank([3, 1, 0.5]), abs=1e-12)
    assert stats["orthogonality_error"] == pytest.approx(math.sqrt((8**2 + 0 + 0.75**2 + 1) / 4), abs=1e-12)
    assert float(rms(a)) == pytest.approx(math.sqrt(10.25 / 16), abs=1e-12)


def test_rtol_decides_which_singular_values_are_kept():
    a = torch.diag(torch.tensor([1.0, 1e-4], dtype=torch.float64))
    assert _stats(a, rtol=1e-3)["sigma_min"] == 1.0
    assert _stats(a, rtol=1e-5)["sigma_min"] == 1e-4


def test_zero_matrix_is_rank_zero_and_batches_are_per_matrix():
    zero = _stats(torch.zeros(4, 3, dtype=torch.float64))
    assert zero == {
        "sigma_max": 0.0,
        "sigma_min": 0.0,
        "stable_rank": 0.0,
        "effective_rank": 0.0,
        "orthogonality_error": 1.0,
    }
    batch = torch.stack([_orthogonal(4), torch.diag(torch.tensor([2.0, 0, 0, 0], dtype=torch.float64))])
    stats = spectrum_stats(singular_values(batch))
    torch.testing.assert_close(stats["stable_rank"], torch.tensor([4.0, 1.0], dtype=torch.float64), **F64)
    torch.testing.assert_close(stats["sigma_max"], torch.tensor([1.0, 2.0], dtype=torch.float64), **F64)


@pytest.mark.parametrize("shape", [(7, 12), (12, 7), (3, 5, 9)])
def test_orthogonality_error_from_singular_values_equals_the_gram_form(shape):
    a = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(orthogonality_error(singular_values(a)), gram_orthogonality_error(a), **F64)


def test_float32_inputs_run_in_float32_and_bad_inputs_raise():
    a = torch.randn(5, 4).to(torch.bfloat16)
    assert singular_values(a).dtype == torch.float32
    assert effective_rank(singular_values(a)).shape == ()
    with pytest.raises(ValueError, match="expected a matrix"):
        singular_values(torch.ones(3))
    with pytest.raises(ValueError, match="rtol must be"):
        SmallestKeptSingularValue(rtol=1.5)


# ---------------------------------------------------------------------- torchmetrics


def test_each_metric_is_the_mean_over_matrices_seen():
    mats = [_orthogonal(4), torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.0], dtype=torch.float64))]
    per = [_stats(m) for m in mats]
    pairs = [
        (LargestSingularValue(), "sigma_max"),
        (SmallestKeptSingularValue(), "sigma_min"),
        (StableRank(), "stable_rank"),
        (EffectiveRank(), "effective_rank"),
        (OrthogonalityError(), "orthogonality_error"),
    ]
    for metric, key in pairs:
        metric.update(mats[0])
        metric.update(mats[1].unsqueeze(0))  # a batch of one counts once
        assert float(metric.compute()) == pytest.approx((per[0][key] + per[1][key]) / 2, abs=1e-12), key
    update_rms, relative = UpdateRMS(), RelativeUpdateRMS()
    update_rms.update(torch.stack(mats))
    relative.update(mats[0], 2 * mats[0])
    assert float(update_rms.compute()) == pytest.approx((0.5 + math.sqrt(10.25 / 16)) / 2, abs=1e-12)
    assert float(relative.compute()) == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(ValueError, match="all zeros"):
        relative.update(mats[0], torch.zeros(4, 4))
    with pytest.raises(ValueError, match="shapes differ"):
        relative.update(mats[0], torch.ones(4, 3))


def test_spectrum_metrics_collects_everything_from_one_svd():
    q, d = _orthogonal(4), torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.0], dtype=torch.float64))
    metric = SpectrumMetrics()
    metric.update(q, weight=2 * q)
    metric.update(d)
    out = {k: float(v) for k, v in metric.compute().items()}
    per = [_stats(q), _stats(d)]
    for key in ("sigma_max", "sigma_min", "stable_rank", "effective_rank", "orthogonality_error"):
        assert out[key] == pytest.approx((per[0][key] + per[1][key]) / 2, abs=1e-12), key
    assert out["update_rms"] == pytest.approx((0.5 + math.sqrt(10.25 / 16)) / 2, abs=1e-12)
    assert out["update_to_weight_rms"] == pytest.approx(0.5, abs=1e-12)  # only the pair with a weight


# ---------------------------------------------------------------------- the observer


def _muon(**group_options) -> tuple[nn.Module, Muon]:
    torch.manual_seed(0)
    module = nn.ModuleDict(
        {
            "attn": nn.Linear(4, 12, bias=False),  # (12, 4), fused qkv
            "mlp": nn.Linear(4, 6, bias=False),  # (6, 4)
            "experts": nn.Linear(1, 1, bias=False),  # replaced by a (2, 3, 5) batch
        }
    )
    module["experts"].weight = nn.Parameter(torch.randn(2, 3, 5))
    opt = Muon(
        [
            {"params": [module["attn"].weight], "algorithm": "muon", "lr": LR, "split_sizes": [4, 4, 4]},
            {"params": [module["mlp"].weight], "algorithm": "muon", "lr": LR, "weight_decay": 0.1, **group_options},
            {"params": [module["experts"].weight], "algorithm": "muon", "lr": LR, "batched": True},
        ]
    )
    return module, opt


def test_observer_reports_the_applied_update_exactly():
    module, opt = _muon()
    collector = SpectrumCollector([opt], module, log_momentum=True, log_weights=True)
    assert [t.name for t in collector.targets] == ["attn.weight", "mlp.weight", "experts.weight"]
    g_attn, g_mlp, g_exp = opt.param_groups
    w_mlp = module["mlp"].weight
    # Known directions: an orthonormal-column O (error 0) and a rank-one O.
    q = _orthogonal(6)[:, :4].float()  # (6, 4)
    collector.observe(g_mlp, [w_mlp], [3 * q], [[q]])
    pieces = [torch.eye(4), 2 * torch.eye(4), torch.zeros(4, 4)]
    collector.observe(g_attn, [module["attn"].weight], [torch.ones(12, 4)], [pieces])
    experts = torch.zeros(2, 3, 5)
    experts[0, 0, 0] = 1.0  # rank one; expert 1 sees a zero update
    collector.observe(g_exp, [module["experts"].weight], [experts], [[experts]])
    by_name = {r.name: r.scalars for r in collector.collect()}
    assert list(by_name) == ["attn.weight[0]", "attn.weight[1]", "attn.weight[2]", "mlp.weight"] + [
        "experts.weight[0]",
        "experts.weight[1]",
    ]

    mlp = by_name["mlp.weight"]
    scale = LR * math.sqrt(6 / 4)  # adjust_lr "original": sqrt(max(1, rows / cols))
    assert mlp["sigma_max"] == pytest.approx(scale, rel=1e-6)
    assert mlp["sigma_min"] == pytest.approx(scale, rel=1e-6)
    assert mlp["stable_rank"] == pytest.approx(4, rel=1e-6)
    assert mlp["effective_rank"] == pytest.approx(4, rel=1e-6)
    assert mlp["orthogonality_error"] == pytest.approx(0, abs=1e-6)
    assert mlp["update_rms"] == pytest.approx(scale / math.sqrt(6), rel=1e-6)  # ||O||_F^2 = 4 over 24
    weight_rms = float(w_mlp.detach().square().mean().sqrt())
    assert mlp["weight_rms"] == pytest.approx(weight_rms, rel=1e-6)
    assert mlp["update_to_weight_rms"] == pytest.approx(scale / math.sqrt(6) / weight_rms, rel=1e-6)
    assert mlp["momentum_sigma_max"] == pytest.approx(3, rel=1e-6)
    assert mlp["momentum_stable_rank"] == pytest.approx(4, rel=1e-6)
    assert mlp["weight_sigma_max"] == pytest.approx(float(torch.linalg.matrix_norm(w_mlp.detach(), 2)), rel=1e-6)

    assert by_name["attn.weight[0]"]["sigma_max"] == pytest.approx(LR, rel=1e-6)
    assert by_name["attn.weight[1]"]["sigma_max"] == pytest.approx(2 * LR, rel=1e-6)
    assert by_name["attn.weight[1]"]["orthogonality_error"] == pytest.approx(3, rel=1e-6)  # s^2 - 1 = 3
    assert by_name["attn.weight[2]"]["stable_rank"] == 0.0
    assert by_name["attn.weight[2]"]["momentum_sigma_max"] == pytest.approx(4, rel=1e-6)  # ones(4, 4)
    assert by_name["experts.weight[0]"]["stable_rank"] == pytest.approx(1, rel=1e-6)
    assert by_name["experts.weight[0]"]["sigma_max"] == pytest.approx(LR, rel=1e-6)  # 3x5: adjust 1
    assert by_name["experts.weight[1]"]["sigma_max"] == 0.0
    assert collector.collect() == []  # records belong to one logging step


def test_non_finite_update_logs_nan_instead_of_raising():
    module, opt = _muon()
    collector = SpectrumCollector([opt], module, names="mlp.*")
    o = torch.eye(6, 4)
    o[0, 0] = float("nan")
    collector.observe(opt.param_groups[1], [module["mlp"].weight], [o], [[o]])
    (record,) = collector.collect()
    keys = ("sigma_max", "sigma_min", "stable_rank", "effective_rank", "orthogonality_error", "update_rms")
    assert all(math.isnan(record.scalars[k]) for k in keys)
    assert record.scalars["weight_rms"] > 0


def test_selection_by_glob_regex_and_size():
    module, opt = _muon()
    names = lambda c: [t.name for t in c.targets]
    everything = ["attn.weight", "mlp.weight", "experts.weight"]
    assert names(SpectrumCollector([opt], module, names=["*.weight"])) == everything
    assert names(SpectrumCollector([opt], module, names=["mlp.*", "re:^exp"])) == ["mlp.weight", "experts.weight"]
    # The two largest by element count (48 and 30), kept in model order.
    assert names(SpectrumCollector([opt], module, max_matrices=2)) == ["attn.weight", "experts.weight"]
    with pytest.raises(ValueError, match=r"names=\['nothing\*'\] match none of the Muon matrices \(attn.weight"):
        SpectrumCollector([opt], module, names=["nothing*"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(every_n_steps=0), "every_n_steps must be an int >= 1"),
        (dict(every_n_steps=2.5), "every_n_steps must be an int >= 1"),
        (dict(every_n_steps=True), "every_n_steps must be an int >= 1"),
        (dict(names=[]), "names must be None or a non-empty list"),
        (dict(names=["ok", 3]), "names must be None or a non-empty list"),
        (dict(max_matrices=0), "max_matrices must be None or an int >= 1"),
        (dict(log_momentum="yes"), "log_momentum must be a bool"),
        (dict(heatmap=1), "heatmap must be a bool"),
        (dict(rtol=0.0), r"rtol must be a number in \(0, 1\)"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, message):
    assert UpdateSpectrumMonitor(names="*.mlp.*").names == ["*.mlp.*"]  # one pattern, as a list
    with pytest.raises(ValueError, match=f"UpdateSpectrumMonitor: {message}"):
        UpdateSpectrumMonitor(**kwargs)


def test_heatmap_image_rows_and_colours():
    image = render_heatmap([torch.ones(4), torch.tensor([2.0, 1.0, 0.0, 0.0])], width=8, col_px=1)
    assert image.shape == (16, 8, 3) and image.dtype == np.uint8
    flat_row, decaying_row = image[0], image[8]
    assert (flat_row == flat_row[0]).all()  # a flat spectrum is one colour
    brightness = decaying_row.astype(int).sum(-1)
    assert brightness[0] == flat_row[0].astype(int).sum() and brightness[0] > brightness[2] > brightness[-1]


# ---------------------------------------------------------------------- Trainer runs


def _demo(tmp_path, monitor, logger, steps: int, accumulate: int = 1, ckpt_path=None, **trainer_kwargs):
    model = CharGPTModule(
        n_layer=2, n_embd=32, block_size=32, muon_config=MuonConfig(matrix=MuonSettings(ns_dtype="float32"))
    )
    data = CharTextDataModule(block_size=32, batch_size=4, max_chars=20_000, train_samples_per_epoch=200)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, trainer


MUON_MATRICES = [
    f"model.blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
]


def _csv_rows(folder) -> list[dict[str, str]]:
    with open(next(folder.rglob("metrics.csv"))) as f:
        return list(csv.DictReader(f))


def test_csv_logger_run_logs_every_key_at_optimizer_steps(tmp_path):
    class Counting(UpdateSpectrumMonitor):
        calls = 0

        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            observe = self._collector.observe

            def counted(*args):
                Counting.calls += 1
                observe(*args)

            self._collector.observe = counted

    monitor = Counting(every_n_steps=2, log_momentum=True)
    # 5 optimizer steps of 2 micro-batches each: logging steps are optimizer steps 0, 2 and 4.
    model, trainer = _demo(tmp_path, monitor, CSVLogger(tmp_path), steps=5, accumulate=2)
    assert Counting.calls == 3  # one Muon group, observed on logging steps only
    assert monitor.logged_steps == 3 and monitor.last_logged_step == 4
    assert not trainer.optimizers[0].has_update_hooks  # removed after the fit
    rows = _csv_rows(tmp_path)
    key = "spectra/model.blocks.0.attn.qkv.weight/sigma_max"
    assert [int(r["step"]) for r in rows if r.get(key)] == [0, 2, 4]
    header = rows[0].keys()
    for name in MUON_MATRICES:
        for metric in (
            "sigma_max",
            "sigma_min",
            "stable_rank",
            "effective_rank",
            "orthogonality_error",
            "update_rms",
            "weight_rms",
            "update_to_weight_rms",
            "momentum_sigma_max",
            "momentum_effective_rank",
        ):
            assert f"spectra/{name}/{metric}" in header, (name, metric)
    assert not any("lm_head" in k or "tok_emb" in k for k in header)  # AdamW parameters are not Muon's
    last = [r for r in rows if r.get(key)][-1]
    # Plain Muon: the applied direction is close to orthogonal (Newton-Schulz error only).
    assert 0 <= float(last["spectra/model.blocks.0.mlp.fc1.weight/orthogonality_error"]) < 0.5
    assert 1 < float(last["spectra/model.blocks.0.mlp.fc1.weight/effective_rank"]) <= 32


def test_tensorboard_event_file_holds_histograms_and_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = UpdateSpectrumMonitor(every_n_steps=3, names=["*.blocks.0.*"], log_weights=True)
    _demo(tmp_path, monitor, TensorBoardLogger(tmp_path), steps=4)
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*"))), size_guidance={"images": 0})
    events.Reload()
    tags = events.Tags()
    watched = [n for n in MUON_MATRICES if ".blocks.0." in n]
    for name in watched:
        assert f"spectra/{name}/singular_values" in tags["histograms"]
        assert f"spectra/{name}/weight_singular_values" in tags["histograms"]
        assert [e.step for e in events.Scalars(f"spectra/{name}/stable_rank")] == [0, 3]
        histogram = events.Histograms(f"spectra/{name}/singular_values")[-1].histogram_value
        assert histogram.num == 32  # k = min(rows, cols) = n_embd singular values
    assert not any(".blocks.1." in t for t in tags["histograms"])
    images = events.Images("spectra/heatmap")
    assert [e.step for e in images] == [0, 3]
    assert images[0].height == 4 * 8 and images[0].width == 256  # four matrices, 8-pixel bands
    assert "spectra/heatmap_rows/text_summary" in tags["tensors"]  # add_text's tag


def test_state_is_checkpointed_and_resumed_without_a_logger(tmp_path):
    first = UpdateSpectrumMonitor(every_n_steps=3)
    with pytest.warns(RuntimeWarning, match="no logger"):
        _demo(tmp_path / "a", first, False, steps=4)
    assert first.last_logged_step == 3 and first.logged_steps == 2
    assert first.last_metrics["spectra/model.blocks.1.mlp.fc2.weight/stable_rank"] > 1
    ckpt_path = next((tmp_path / "a").rglob("*.ckpt"))
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["callbacks"][first.state_key] == {"last_logged_step": 3, "logged_steps": 2}

    resumed = UpdateSpectrumMonitor(every_n_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _demo(tmp_path / "b", resumed, False, steps=7, ckpt_path=ckpt_path)
    # Loaded the state, then logged optimizer step 6 only (step 3 was logged before the save).
    assert resumed.last_logged_step == 6 and resumed.logged_steps == 3


# ---------------------------------------------------------------------- two ranks

WATCHED = ["net.0.weight", "net.2.weight", "net.4.weight"]  # SpectraRegressor's Muon matrices


def _logged(folder) -> list[dict[str, float]]:
    rows = _csv_rows(folder)
    return [{k: float(v) for k, v in r.items() if k.startswith("spectra/") and v} for r in rows]


@pytest.fixture(scope="module")
def one_process_logs(tmp_path_factory) -> list[dict[str, float]]:
    root = tmp_path_factory.mktemp("one")
    monitor = UpdateSpectrumMonitor(every_n_steps=EVERY)
    pl.Trainer(devices=1, logger=CSVLogger(root), callbacks=[monitor], **TRAINER).fit(SpectraRegressor(CONFIG))
    return _logged(root)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-process gloo run: metrics sync, hand-made DTensors and a ``muon_fsdp`` fit."""
    root = tmp_path_factory.mktemp("distributed")
    return root, run_distributed(distributed_worker, 2, root)


def _assert_each_matrix_measured_once(folder) -> None:
    measured = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(measured[0]) == len(measured[1]) == 3  # logging steps 0, 2, 4 on both ranks
    for step in range(3):
        mine, theirs = set(measured[0][step]), set(measured[1][step])
        assert mine and theirs and not mine & theirs  # split between the owners, none twice
        assert mine | theirs == set(WATCHED)


def _assert_same_spectra(logs: list[dict[str, float]], reference: list[dict[str, float]]) -> None:
    assert len(logs) == len(reference) == 3
    assert set(logs[0]) == {f"spectra/{n}/{m}" for n in WATCHED for m in UpdateSpectrumMonitor.METRICS}
    for got, want in zip(logs, reference):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], **RANKS), key


def test_muon_ddp_computes_each_spectrum_once_and_matches_one_process(tmp_path, one_process_logs):
    monitor = OwnershipMonitor(str(tmp_path), every_n_steps=EVERY)
    trainer = pl.Trainer(
        devices=2, strategy="muon_ddp_spawn", logger=CSVLogger(tmp_path), callbacks=[monitor], **TRAINER
    )
    trainer.fit(SpectraRegressor(CONFIG))
    _assert_each_matrix_measured_once(tmp_path)
    _assert_same_spectra(_logged(tmp_path), one_process_logs)


def test_muon_fsdp_computes_each_spectrum_once_and_matches_one_process(distributed, one_process_logs):
    root, results = distributed
    assert all(r["fsdp_param_types"] == ["DTensor"] for r in results)  # really FSDP2 parameters
    _assert_each_matrix_measured_once(root)
    # Weight RMS included: DTensor rows are summed before the step, as a plain weight is read.
    _assert_same_spectra(_logged(root), one_process_logs)


def test_metrics_sync_across_ranks(distributed):
    _, results = distributed
    # torchmetrics: every rank's compute() is the mean over both ranks' matrices.
    union = [matrix for r in range(2) for m in _rank_matrices(r) for matrix in m.reshape(-1, *m.shape[-2:])]
    per = [spectrum_stats(singular_values(m)) for m in union]  # each matrix once
    expected = {k: sum(float(p[k]) for p in per) / len(union) for k in ("sigma_max", "stable_rank", "effective_rank")}
    ratio = sum(float(rms(m) / rms(m + 1.0)) for m in union) / len(union)
    for result in results:
        for key, value in expected.items():
            assert result["metrics"][key] == pytest.approx(value, rel=1e-12), key
            assert result["spectrum"][key] == pytest.approx(value, rel=1e-12), key
        assert result["spectrum"]["update_to_weight_rms"] == pytest.approx(ratio, rel=1e-12)


def test_dtensor_weights_give_exact_values_without_gathering_a_matrix(distributed):
    _, results = distributed
    # DTensor weights: each rank holds half the rows; the owners observed, rank 0 has it all.
    assert all(r["observes_on"] and r["has_dtensors"] for r in results)
    assert results[0]["local_rows"] == [3, 5] and results[1]["local_rows"] == [3, 4]
    assert results[1]["records"] is None
    assert all(r["skipped_weight_spectra"] for r in results)  # no weight spectrum without the full matrix
    w_plain, w_fused = results[0]["full"]
    by_name = dict(results[0]["records"])
    assert list(by_name) == ["plain", "fused[0]", "fused[1]"]
    cases = [
        ("plain", math.sqrt(6 / 4), 1.0, 4, w_plain),
        ("fused[0]", 1.0, 2.0, 3, w_fused[:3]),
        ("fused[1]", math.sqrt(6 / 5), 1.0, 5, w_fused[3:]),
    ]
    for name, adjust, s, k, weight in cases:
        got = by_name[name]
        rows, cols = weight.shape
        update_rms = LR * adjust * s * math.sqrt(k / (rows * cols))
        weight_rms = float(weight.square().mean().sqrt())
        assert got["sigma_max"] == pytest.approx(LR * adjust * s, rel=1e-6), name
        assert got["orthogonality_error"] == pytest.approx(abs(s * s - 1), abs=1e-6), name
        assert got["update_rms"] == pytest.approx(update_rms, rel=1e-6), name
        assert got["weight_rms"] == pytest.approx(weight_rms, rel=1e-6), name
        assert got["update_to_weight_rms"] == pytest.approx(update_rms / weight_rms, rel=1e-6), name
        assert "weight_sigma_max" not in got
