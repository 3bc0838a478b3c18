"""Module-level code for the resume matrix (``test_resume_matrix.py``): spawned ranks import it by name.

``Lanes`` is one small model whose parts are routed to every built-in algorithm at once, a
routing ``Rule`` per layer. Lane ``i`` is ``Linear(8, rows) -> LayerNorm -> tanh ->
Linear(rows, 3)``: its hidden matrix steps with the matrix algorithm ``MATRIX[i]``, the rest
of it (biases, the norm, the 3-row output matrix) with the scalar algorithm
``SCALAR[i % 4]``. The loss is the sum of the lanes' own losses, so no lane's gradient reads
another lane's weights, and what a rounding amplifier (SOAP, REKLS) makes of an ulp stays in
its lane; gradient clipping by the global norm (1.0, against a first norm near 4) acts on
every step. Every step sees the same 12 samples at any world size (rank ``r`` of ``W`` takes
the ``r``-th contiguous ``12 / W`` of them), so a resumed fit replays nothing that matters.

``matrix_worker`` runs a list of fits on one rank, one after another in the process group
``dist_utils.run_distributed`` made (Lightning takes the processes as torchrun's): fits that
save a checkpoint every 2 steps, fits that resume one under another strategy, and the
``convert-checkpoint`` of a ``muon_fsdp`` folder. ``run_matrix`` is the whole matrix: one
launch of 2 ranks, one of 1 and one of 3.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_muon import (
    AdamWSettings,
    LionSettings,
    MomentumWarmup,
    MuonConfig,
    MuonModuleMixin,
    MuonSettings,
    RoutingSettings,
    Rule,
    ScheduleFreeSettings,
    ScheduleSettings,
)
from lightning_muon.algorithms import sinkhorn_knopp

MATRIX = (
    "muon",
    "muon_hyperball",
    "adaptive_muon",
    "scion",
    "polargrad",
    "mop",
    "spel",
    "sinkhorn_muon",
    "soap",
    "rekls",
)
SCALAR = ("adamw", "lion", "laprop", "adamw_schedulefree")
AMPLIFIERS = ("soap", "rekls")  # their normalization turns rounding noise in near-zero entries into +-1
# Rows of each lane's hidden matrix: 9 split 5 + 4 over 2 ranks, 7 split 3 + 3 + 1 over 3.
ROWS = (9, 7, 9, 7, 9, 7, 9, 7, 9, 7)
# The eps that shrinks what SOAP and REKLS make of float32 rounding 1500 and 650 times (docs/algorithms.md).
TAMED = {"soap": 1e-4, "rekls": 1e-3}
F32 = {"ns_dtype": "float32"}  # bf16 Newton-Schulz turns ulps of another reduction order into percents
# An lr that moves each lane, float32 Newton-Schulz, and the forms that act at lr = 0: a
# fixed hyperball radius (a weight is rescaled before its first step), PolarGrad's
# "independent" decay W (1 - wd), Spel's projection, Sinkhorn-Muon's map. SOAP and REKLS
# with the eps that tames their amplification of rounding (TAMED; docs/algorithms.md).
MUON_LANE = {"lr": 0.02, "weight_decay": 0.1, **F32}  # Muon's variants at the config's Muon settings
MATRIX_OPTIONS: dict[str, dict[str, Any]] = {
    "muon": {},
    "muon_hyperball": {**MUON_LANE, "hyperball_radius": 2.0},
    "adaptive_muon": {**MUON_LANE, "moment2_method": "normuon"},
    "scion": {"lr": 0.01, **F32},
    "polargrad": {"lr": 0.01, "weight_decay_method": "independent", **F32},
    "mop": {"lr": 0.01},
    "spel": {"lr": 0.01, **F32},
    "sinkhorn_muon": {"lr": 0.01, **F32},
    "soap": {"lr": 0.01, "eps": TAMED["soap"]},
    "rekls": {"lr": 0.01, "eps": TAMED["rekls"]},
}
DEFAULT_EPS = {name: {**MATRIX_OPTIONS[name], "eps": 1e-8} for name in AMPLIFIERS}  # their default
SAMPLES = 12  # per optimizer step, split evenly over 1, 2 and 3 ranks
STEPS, SAVE_EVERY = 4, 2


def lane_algorithms(i: int) -> tuple[str, str]:
    """``(matrix algorithm, scalar algorithm)`` of lane ``i``."""
    return MATRIX[i], SCALAR[i % len(SCALAR)]


def lane_of(name: str) -> int:
    """The lane of a parameter name (``lanes.<i>.hidden.weight``)."""
    return int(name.split(".")[1])


def rules(matrix_options: dict[str, dict[str, Any]]) -> list[Rule]:
    """A rule per hidden matrix, then one per lane for the rest of it (one group per scalar algorithm)."""
    out = []
    for i in range(len(MATRIX)):
        matrix, scalar = lane_algorithms(i)
        out.append(
            Rule(
                name=f"lane{i}_{matrix}",
                algorithm=matrix,
                names=f"lanes.{i}.hidden.weight",
                options=matrix_options[matrix],
            )
        )
        out.append(Rule(name=f"lane{i}_rest", algorithm=scalar, names=f"lanes.{i}.*", group=scalar))
    return out


def config(matrix_options: dict[str, dict[str, Any]] | None = None) -> MuonConfig:
    return MuonConfig(
        matrix=MuonSettings(lr=0.02, weight_decay=0.1, ns_dtype="float32"),
        scalar=AdamWSettings(lr=1e-2, weight_decay=0.01),
        # Lion and Schedule-Free AdamW at AdamW's lr and decay, LaProp at its own lr.
        others=[LionSettings(lr=1e-2, weight_decay=0.01), ScheduleFreeSettings(lr=1e-2, weight_decay=0.01)],
        routing=RoutingSettings(rules=rules({**MATRIX_OPTIONS, **(matrix_options or {})}), default_rules=False),
        schedule=ScheduleSettings(warmup=2, momentum_warmup=MomentumWarmup(steps=3)),
    )


class Lane(nn.Module):
    def __init__(self, rows: int, sinkhorn: bool) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, rows)
        self.norm = nn.LayerNorm(rows)
        self.out = nn.Linear(rows, 3)
        if sinkhorn:  # sinkhorn_muon's weights start Sinkhorn-normalized
            with torch.no_grad():
                self.hidden.weight.copy_(sinkhorn_knopp(self.hidden.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.hidden(x))))


class Lanes(MuonModuleMixin, pl.LightningModule):
    """The lanes of the module docstring; ``reversed=True`` sums each rank's batch in the other order."""

    def __init__(self, muon_config: MuonConfig | None = None, reversed: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.lanes = nn.ModuleList(Lane(rows, m == "sinkhorn_muon") for rows, m in zip(ROWS, MATRIX))

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        size = SAMPLES // world
        indices = list(range(rank * size, (rank + 1) * size))
        if self.hparams.reversed:
            indices.reverse()
        return torch.utils.data.DataLoader(torch.utils.data.Subset(dataset(), indices), batch_size=size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return sum(nn.functional.mse_loss(lane(x), y) for lane in self.lanes)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 3, generator=g))


def initial_weights() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in Lanes(config()).state_dict().items()}


def _strategy(name: str) -> Any:
    from lightning_muon import MuonDDPStrategy, MuonFSDPStrategy

    return {"muon_ddp": MuonDDPStrategy, "muon_fsdp": MuonFSDPStrategy}.get(name, lambda: name)()


def fit(world: int, rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One ``Trainer.fit`` as ``spec`` says; the full weights (on rank 0) and the global step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = Lanes(config(spec.get("matrix_options")), reversed=spec.get("reversed", False))
    callbacks = []
    if spec.get("save_to"):
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=spec["save_to"], filename="{step}", every_n_train_steps=SAVE_EVERY, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=_strategy(spec["strategy"]),
        max_steps=STEPS,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=spec["root"],
        gradient_clip_val=1.0,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=spec.get("ckpt_path"))
    if spec["strategy"] == "muon_fsdp":
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": state if rank == 0 else None, "global_step": trainer.global_step}


def matrix_worker(rank: int, world: int, specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every fit of ``specs`` in order on this rank, by tag (a spec with ``"convert"`` converts on rank 0)."""
    import torch.distributed as dist

    from lightning_muon.checkpoints import convert_checkpoint

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes made outside Lightning
    out: dict[str, Any] = {}
    for spec in specs:
        if "convert" in spec:
            if rank == 0:
                convert_checkpoint(*spec["convert"])
            dist.barrier()
        else:
            out[spec["tag"]] = fit(world, rank, spec)
    return out


def saved(root: Path, source: str, step: int) -> Path:
    """The checkpoint the 2-rank fit under ``source`` ("muon_ddp", "muon_fsdp") saved at ``step``, or its
    conversion ("converted")."""
    if source == "converted":
        return root / f"converted_step{step}.ckpt"
    return root / source / f"step={step}.ckpt"


def resume_tag(strategy: str, world: int, source: str, done: bool = False) -> str:
    """``"muon_fsdp@2<muon_ddp"``: the fit under ``strategy`` at ``world`` ranks that resumed ``source``'s
    step-2 checkpoint; ``"done ..."`` resumed the step-4 one, with ``max_steps`` reached."""
    return f"{'done ' if done else ''}{strategy}@{world}<{source}"


# (strategy, world) -> the checkpoints it resumes at step 2 (and at step 4, with max_steps reached).
RESUMES: dict[tuple[str, int], tuple[list[str], list[str]]] = {
    ("auto", 1): (["muon_ddp", "converted"], ["muon_ddp"]),
    ("auto", 2): (["muon_ddp"], []),
    ("muon_ddp", 1): (["muon_ddp"], []),
    ("muon_ddp", 2): (["muon_ddp", "converted"], ["muon_ddp"]),
    ("muon_ddp", 3): (["muon_ddp"], []),
    ("muon_fsdp", 1): (["muon_ddp", "muon_fsdp", "converted"], ["muon_fsdp"]),
    ("muon_fsdp", 2): (["muon_ddp", "muon_fsdp", "converted"], ["muon_ddp", "muon_fsdp"]),
    ("muon_fsdp", 3): (["muon_ddp", "muon_fsdp"], []),
}


def _resumes(root: Path, world: int) -> list[dict[str, Any]]:
    specs = []
    for (strategy, w), (sources, done) in RESUMES.items():
        if w != world:
            continue
        for source, step, finished in [(s, SAVE_EVERY, False) for s in sources] + [(s, STEPS, True) for s in done]:
            tag = resume_tag(strategy, world, source, finished)
            ckpt = saved(root, source, step)
            specs.append(dict(tag=tag, strategy=strategy, root=root / tag.replace(" ", "_"), ckpt_path=ckpt))
    return specs


def run_matrix(root: Path) -> dict[str, dict[str, Any]]:
    """Every fit of the matrix, by tag, as rank 0 saw it.

    2 ranks: the uninterrupted fits under ``muon_ddp`` and ``muon_fsdp`` that save at steps 2
    and 4 (one file, one folder), ``muon_ddp`` with SOAP's and REKLS's default eps, the folders'
    conversion, and the resumes at 2. 1 rank: the uninterrupted fit, the same with each
    rank's batch reversed (the reordering control), both again with the default eps, and the
    resumes at 1. 3 ranks: the resumes at 3.
    """
    from dist_utils import run_distributed

    saving = [
        dict(tag="muon_ddp", strategy="muon_ddp", root=root / "ddp", save_to=root / "muon_ddp"),
        dict(tag="muon_fsdp", strategy="muon_fsdp", root=root / "fsdp", save_to=root / "muon_fsdp"),
        dict(tag="muon_ddp default eps", strategy="muon_ddp", root=root / "ddp8", matrix_options=DEFAULT_EPS),
        *(dict(convert=(saved(root, "muon_fsdp", s), saved(root, "converted", s))) for s in (SAVE_EVERY, STEPS)),
    ]
    one = [
        dict(tag="one", strategy="auto", root=root / "one"),
        dict(tag="one reversed", strategy="auto", root=root / "one_r", reversed=True),
        dict(tag="one default eps", strategy="auto", root=root / "one8", matrix_options=DEFAULT_EPS),
        dict(
            tag="one default eps reversed",
            strategy="auto",
            root=root / "one8r",
            matrix_options=DEFAULT_EPS,
            reversed=True,
        ),
    ]
    out: dict[str, dict[str, Any]] = {}
    for world, specs in ((2, saving + _resumes(root, 2)), (1, one + _resumes(root, 1)), (3, _resumes(root, 3))):
        out.update(run_distributed(matrix_worker, world, specs)[0])
    return out


# ---------------------------------------------------------------- the table in docs/distributed.md


def largest_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names) -> float:
    return max(float((params[n] - reference[n]).abs().max()) for n in names)


def algorithm_params(names) -> dict[str, list[str]]:
    """Each algorithm's parameters among ``names``; a scalar algorithm's outside the SOAP and REKLS lanes,
    which carry their lane's amplification."""
    out: dict[str, list[str]] = {name: [] for name in (*MATRIX, *SCALAR)}
    for n in names:
        matrix, scalar = lane_algorithms(lane_of(n))
        if n.endswith("hidden.weight"):
            out[matrix].append(n)
        elif matrix not in AMPLIFIERS:
            out[scalar].append(n)
    return out


def table(runs: dict[str, dict[str, Any]]) -> str:
    """The matrix as Markdown: per algorithm, the largest difference from the uninterrupted one-process
    run, over the fits of each column (every checkpoint it resumed)."""
    reference = runs["one"]["params"]
    columns = {"reordered": ["one reversed"], "2 ranks": ["muon_ddp", "muon_fsdp"]}
    for (strategy, world), (sources, _) in RESUMES.items():
        columns[f"{strategy} @{world}"] = [resume_tag(strategy, world, s) for s in sources]
    lines = [
        "| algorithm | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for algorithm, names in algorithm_params(reference).items():
        cells = [
            f"{max(largest_difference(runs[tag]['params'], reference, names) for tag in tags):.1e}"
            for tags in columns.values()
        ]
        lines.append(f"| `{algorithm}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
