"""``python -m lightning_muon fit --config <name>`` (or ``configs/<name>.yaml``), each run its own process."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from dist_utils import run_main

from lightning_muon import (
    AdamWSettings,
    MomentumWarmup,
    MuonConfig,
    MuonSettings,
    ScheduleFreeSettings,
    ScheduleSettings,
)
from lightning_muon.algorithms import algorithm_names, per_matrix
from lightning_muon.aliases import aliases_of
from lightning_muon.cli import main
from lightning_muon.megatron import MEGATRON_DEFAULTS, MEGATRON_REFUSED
from lightning_muon_demo.module import CharGPTModule

ROOT = Path(__file__).resolve().parents[1]

# The README's configs with everything made tiny: 3 steps of a 1-layer, 32-wide model.
# Note: LightningCLI parses --trainer.limit_val_batches=1 as the float 1.0 (Trainer annotates
# it Union[float, int]), which means "all validation batches"; val_samples=8 keeps that at 2.
TINY = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.block_size=16",
    "--data.init_args.max_chars=20000",
    "--data.init_args.batch_size=4",
    "--data.init_args.val_samples=8",
]
TINY_CHARGPT = [
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=32",
    "--model.init_args.n_head=2",
    "--model.init_args.block_size=16",
]


def _cli(cwd: Path, *args: str, pythonpath: Path | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m lightning_muon *args`` run in ``cwd``, ``pythonpath`` put first on the path.

    Forked from the suite's server, which has torch and Lightning imported already
    (``dist_utils.run_main``); ``fresh=True`` starts the interpreter itself, as a user's
    command line does.
    """
    if not fresh:
        return run_main("lightning_muon", list(args), cwd, pythonpath=pythonpath)
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    # The timeout only guards against a hang; each run takes a few seconds.
    return subprocess.run(
        [sys.executable, "-m", "lightning_muon", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _fit(tmp_path: Path, config: str, *extra: str, pythonpath: Path | None = None) -> str:
    # "muon.yaml": the file of configs/ by path; "muon": the bundled config by name, as from the wheel.
    where = ROOT / "configs" / config if config.endswith(".yaml") else config
    args = ["fit", f"--config={where}", *TINY, *extra, f"--trainer.default_root_dir={tmp_path}"]
    proc = _cli(tmp_path, *args, pythonpath=pythonpath)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def _routing_table(output: str) -> dict[str, tuple[str, int]]:
    """Group -> (algorithm, tensors) from the routing report the CLI prints (one row per group and rule)."""
    lines = output.splitlines()
    start = lines.index("Muon routing")
    assert lines[start + 1].split()[:6] == ["group", "algorithm", "rule", "layout", "tensors", "elements"]
    table: dict[str, tuple[str, int]] = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if len(cells) < 6 or not cells[4].isdigit():
            break
        algorithm, tensors = table.get(cells[0], (cells[1], 0))
        table[cells[0]] = (algorithm, tensors + int(cells[4]))
    return table


def _checkpoint_path(tmp_path: Path) -> Path:
    paths = sorted(tmp_path.rglob("*.ckpt"))
    assert [p.name for p in paths] == ["epoch=0-step=3.ckpt"]
    return paths[0]


def _checkpoint(tmp_path: Path) -> dict:
    return torch.load(_checkpoint_path(tmp_path), weights_only=True)


# Lightning's own instantiate_module (used by load_from_checkpoint) calls a deprecated jsonargparse API.
JSONARGPARSE_DEPRECATION = "ignore:(?s).*(instantiate_classes.. was deprecated|JsonargparseDeprecationWarning)"


@pytest.mark.filterwarnings(f"{JSONARGPARSE_DEPRECATION}:DeprecationWarning")
def test_cli_fits_configs_muon_yaml(tmp_path):
    output = _fit(tmp_path, "muon", *TINY_CHARGPT)  # by its short name (tests/test_packaging.py: from the wheel)
    # qkv, proj, fc1, fc2 on Muon; two embeddings and lm_head on AdamW; 2 LNs x 2 + 4 biases + ln_f x 2.
    assert _routing_table(output) == {"adamw": ("adamw", 3), "adamw_no_decay": ("adamw", 10), "muon": ("muon", 4)}
    checkpoint = _checkpoint(tmp_path)
    assert checkpoint["global_step"] == 3
    # LightningCLI saves the parsed arguments as hyperparameters (plus an "_instantiator"),
    # so the config is a plain dict here, not the MuonConfig the module was given.
    hparams = checkpoint["hyper_parameters"]
    config = MuonConfig.from_any(hparams["muon_config"])
    assert (config.matrix.lr, config.matrix.adjust_lr, config.schedule.falloff, config.schedule.momentum_warmup) == (
        0.02,
        "match_rms_adamw",
        "wsd",
        MomentumWarmup(start=0.85, steps=100),
    )
    assert type(config.matrix) is MuonSettings and type(config.scalar) is AdamWSettings
    assert hparams["n_embd"] == 32
    # load_from_checkpoint rebuilds the module through the CLI's parser: the config is typed again.
    module = CharGPTModule.load_from_checkpoint(_checkpoint_path(tmp_path))
    assert module.hparams["muon_config"] == config
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(tensor, checkpoint["state_dict"][name], rtol=0, atol=0)
    # The schedule was sized from the trainer: wsd over max_steps=3 is a linear falloff.
    schedule = checkpoint["lr_schedulers"][0]["schedule"]
    assert (schedule["falloff"], schedule["total_steps"]) == ("linear", 3)
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert sorted((g["name"], g["algorithm"]) for g in groups) == [
        ("adamw", "adamw"),
        ("adamw_no_decay", "adamw"),
        ("muon", "muon"),
    ]


def test_cli_fits_configs_adamw_yaml_with_adamw_groups_only(tmp_path):
    output = _fit(tmp_path, "adamw.yaml", *TINY_CHARGPT)
    table = _routing_table(output)
    assert table == {"adamw": ("adamw", 7), "adamw_no_decay": ("adamw", 10)}  # 7: 4 hidden + 2 embeddings + head
    groups = _checkpoint(tmp_path)["optimizer_states"][0]["param_groups"]
    assert {g["algorithm"] for g in groups} == {"adamw"}
    assert {g["name"]: g["weight_decay"] for g in groups} == {"adamw": 0.01, "adamw_no_decay": 0.0}
    assert all(g["lr"] == pytest.approx(0.0) for g in groups)  # wsd ends at min_lr_ratio 0 after 3 steps


def test_cli_fits_configs_muon_schedulefree_yaml(tmp_path):
    # The config's 30-step warmup is longer than this 3-step run, which is refused: 3 here.
    output = _fit(tmp_path, "muon_schedulefree.yaml", *TINY_CHARGPT, "--model.init_args.muon_config.schedule.warmup=3")
    sf = "adamw_schedulefree"
    assert _routing_table(output) == {sf: (sf, 3), f"{sf}_no_decay": (sf, 10), "muon": ("muon", 4)}
    checkpoint = _checkpoint(tmp_path)
    config = MuonConfig.from_any(checkpoint["hyper_parameters"]["muon_config"])
    assert type(config.scalar) is ScheduleFreeSettings and config.scalar.algorithm == sf
    assert (config.scalar.lr, config.schedule.falloff, config.schedule.warmup) == (0.003, "constant", 3)
    # Constant falloff: the run's length is not needed, and no group decays.
    assert checkpoint["lr_schedulers"][0]["schedule"]["total_steps"] is None
    state = checkpoint["optimizer_states"][0]
    groups = {g["name"]: g for g in state["param_groups"]}
    # Saved after the validation at step 3: eval mode, three schedule-free steps counted.
    assert [(g["train_mode"], g["k"]) for g in (groups[sf], groups[f"{sf}_no_decay"])] == [(False, 3)] * 2
    assert groups[sf]["lr"] == pytest.approx(0.003)  # the next (4th) step: warmup done, and no falloff
    assert all({"z", "exp_avg_sq"} <= set(state["state"][i]) for i in groups[sf]["params"])


USER_MODULE = '''
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_muon import MuonConfig, MuonModuleMixin


    class TinyLM(MuonModuleMixin, pl.LightningModule):
        """A user's own model: embedding, one hidden matrix, a head."""

        def __init__(self, vocab_size: int = 256, n_embd: int = 16, muon_config: MuonConfig | None = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.emb = nn.Embedding(vocab_size, n_embd)
            self.hidden = nn.Linear(n_embd, n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size)

        def _loss(self, batch):
            x, y = batch
            logits = self.lm_head(torch.tanh(self.hidden(self.emb(x))))
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))
'''


def test_cli_fits_a_users_module_by_class_path(tmp_path):
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "user_tiny_lm.py").write_text(textwrap.dedent(USER_MODULE))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # muon.yaml's CharGPT arguments do not fit TinyLM and are dropped; its muon_config is kept.
    output = _fit(
        run_dir,
        "muon.yaml",
        "--model.class_path=user_tiny_lm.TinyLM",
        "--model.init_args.n_embd=24",
        "--model.init_args.muon_config.matrix.init_args.lr=0.05",
        pythonpath=package,
    )
    # adamw: emb.weight, lm_head.weight; adamw_no_decay: hidden.bias, lm_head.bias
    assert _routing_table(output) == {"adamw": ("adamw", 2), "muon": ("muon", 1), "adamw_no_decay": ("adamw", 2)}
    checkpoint = _checkpoint(run_dir)
    hparams = checkpoint["hyper_parameters"]
    assert hparams["n_embd"] == 24 and "n_layer" not in hparams
    matrix = hparams["muon_config"]["matrix"]["init_args"]  # the one field given over muon.yaml's section
    assert (matrix["lr"], matrix["adjust_lr"]) == (0.05, "match_rms_adamw")
    assert checkpoint["state_dict"]["hidden.weight"].shape == (24, 24)


# tests/cli_user_model.py: a model with its own float loaders, which byte text would crash.
TESTS = ROOT / "tests"
QUICK = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]


def test_cli_readme_line_trains_a_users_model_on_its_own_loaders(tmp_path):
    # The README's line: muon.yaml names the demo datamodule (for the demo model), which
    # would win over the model's loaders; the CLI leaves it out and says so.
    proc = _cli(
        tmp_path,
        "fit",
        "--config",
        str(ROOT / "configs" / "muon.yaml"),
        "--model.class_path=cli_user_model.UserModel",
        *QUICK,
        pythonpath=TESTS,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "UserModel defines train_dataloader: not using the demo datamodule" in output
    assert _routing_table(output)["muon"] == ("muon", 2)  # net.0 and net.2
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert saved["data"] is None and saved["model"]["class_path"] == "cli_user_model.UserModel"
    # muon.yaml's optimizer settings are kept.
    assert saved["model"]["init_args"]["muon_config"]["matrix"]["init_args"]["lr"] == 0.02
    # ... and a note says so, with the form that starts from the model's own defaults instead.
    assert (
        "--config muon was written for lightning_muon_demo.CharGPTModule; "
        "cli_user_model.UserModel keeps from it the trainer settings and model.init_args.muon_config, not "
        "block_size, n_layer, n_head, n_embd. --model.init_args.muon_config=null starts from your model's defaults "
        "instead (then set single fields: --model.init_args.muon_config.matrix.init_args.lr=0.01)"
    ) in output


def test_cli_bundled_config_with_the_users_model_and_muon_config_null_takes_the_models_defaults(tmp_path):
    proc = _cli(
        tmp_path,
        "fit",
        "--config",
        "muon",
        "--model.class_path=cli_user_model.UserModel",
        "--model.init_args.muon_config=null",
        "--model.init_args.muon_config.schedule.falloff=cosine",
        *QUICK,
        pythonpath=TESTS,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())["model"]["init_args"]["muon_config"]
    # MuonConfig's defaults, and the one field given: none of muon.yaml's (lr 0.02, wsd, adjust_lr ...).
    assert MuonConfig.from_any(saved) == MuonConfig(schedule=ScheduleSettings(falloff="cosine"))
    assert "was written for" not in output
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in output


USER_CONFIG = """\
# My run. These comments are mine; the CLI must not replace this file.
trainer:
  logger: false            # no logger: the log dir is the working directory
  enable_checkpointing: false
model:
  class_path: cli_user_model.UserModel
  init_args:
    hidden: 12
# no data: the model has its own loaders
"""


def test_cli_never_writes_over_its_input_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_bytes(USER_CONFIG.encode())
    proc = _cli(tmp_path, "fit", "--config", "config.yaml", *QUICK, pythonpath=TESTS)
    output = proc.stdout + proc.stderr
    assert config.read_bytes() == USER_CONFIG.encode(), output[-4000:]
    assert proc.returncode == 0, output[-4000:]
    saved = tmp_path / "config_1.yaml"
    assert f"The run's config: {saved}" in output
    assert yaml.safe_load(saved.read_text())["model"]["init_args"]["hidden"] == 12
    # A second run in the same directory replaces its own earlier save, not the input.
    proc = _cli(tmp_path, "fit", "--config", "config.yaml", *QUICK, "--model.init_args.hidden=10", pythonpath=TESTS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert config.read_bytes() == USER_CONFIG.encode()
    assert yaml.safe_load(saved.read_text())["model"]["init_args"]["hidden"] == 10
    assert sorted(p.name for p in tmp_path.glob("*.yaml")) == ["config.yaml", "config_1.yaml"]


TIP = (
    "tip: python -m lightning_muon fit --help lists the options; python -m lightning_muon options NAME lists the "
    "settings of an algorithm (muon, adamw, ...) or a config section (state, routing, schedule)"
)


@pytest.mark.parametrize(
    ("bad", "expect"),
    [
        (  # a setting's value, refused when the section's settings are built: the field as written
            ["--model.init_args.muon_config.matrix.init_args.momentum=1.5"],
            "error: MuonSettings.momentum must be a finite number in [0.0, 1.0), got 1.5",
        ),
        (  # a setting's name, refused when the section is built: the nearest setting
            ["--model.init_args.muon_config.matrix.init_args.lrr=0.1"],
            "error: MuonConfig.matrix: ['lrr'] are not settings of 'muon'; did you mean 'lr'?",
        ),
        (  # a setting's choice in a config file, the section's class by its short name as configs/ write it
            [
                "--config",
                "model: {init_args: {muon_config: {matrix: {class_path: MuonSettings, init_args: {adjust_lr: sqrt}}}}}",
            ],
            "error: model.init_args.muon_config: MuonSettings.adjust_lr: not one of 'original', 'match_rms_adamw', "
            "'spectral', 'spectral_norm', 'none'",
        ),
        # An unknown option, named as written, with the module's options when none is close.
        (
            ["--model.init_args.learning_rate=0.1"],
            "error: model.init_args.learning_rate: CharGPTModule has no option 'learning_rate'; its options: "
            "vocab_size, block_size, n_layer, n_head, n_embd, dropout, tie_weights, muon_config",
        ),
        (
            ["--config=mun"],
            "error: argument -c/--config: 'mun' is neither a file nor a bundled config "
            "(bundled: adamw, muon, muon_ddp, muon_fsdp, muon_schedulefree)",
        ),
    ],
    ids=["bad_value", "bad_setting_name", "bad_choice_in_a_config", "typo", "unknown_config"],
)
def test_cli_bad_input_is_reported_first_without_tracebacks(capsys, monkeypatch, tmp_path, bad, expect):
    # In this process (each a process of its own cost 5 s); the next test runs one as a command.
    monkeypatch.setattr(sys, "argv", ["lightning_muon"])  # not pytest's own arguments
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(ROOT / "configs" / "muon.yaml"), *QUICK, *bad])
    stderr = capsys.readouterr().err
    lines = stderr.splitlines()
    assert exited.value.code == 2, stderr[-4000:]
    found = (expect.search(line) if isinstance(expect, re.Pattern) else expect in line for line in lines[:3])
    assert any(found), stderr[-4000:]
    assert "Traceback" not in stderr and len(lines) < 25


def test_cli_bad_input_from_the_command_line_exits_2_naming_it_without_a_traceback(tmp_path):
    bad = "--model.init_args.muon_config.matrix.init_args.momentum=1.5"
    proc = _cli(tmp_path, "fit", "--config", str(ROOT / "configs" / "muon.yaml"), *QUICK, bad, fresh=True)
    assert proc.returncode == 2, proc.stderr[-4000:]
    expect = "error: MuonSettings.momentum must be a finite number in [0.0, 1.0), got 1.5"
    assert expect in proc.stderr.splitlines()[:3], proc.stderr[-4000:]  # after Lightning's "Seed set to 0" at most
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 25


@pytest.mark.parametrize(
    ("bad", "first_line"),
    [
        (  # a typo in a choice: the field as written, its choices, the nearest
            ["--model.init_args.muon_config.schedule.falloff=cosin"],
            "error: model.init_args.muon_config.schedule.falloff: 'cosin' is not one of 'constant', 'linear', "
            "'cosine', 'wsd', 'inverse_sqrt'; did you mean 'cosine'?",
        ),
        (  # an unknown section: the nearest valid name
            ["--model.init_args.muon_config.matrx=MuonSettings"],
            "error: model.init_args.muon_config.matrx: MuonConfig has no option 'matrx'; did you mean 'matrix'?",
        ),
        (  # an unknown option of a section: the nearest of the section's own
            ["--model.init_args.muon_config.schedule.warmpu=3"],
            "error: model.init_args.muon_config.schedule.warmpu: ScheduleSettings has no option 'warmpu'; "
            "did you mean 'warmup'?",
        ),
        (  # the same typo in a choice from a config file
            ["--config", "model: {init_args: {muon_config: {schedule: {falloff: cosin}}}}"],
            "error: model.init_args.muon_config.schedule.falloff: 'cosin' is not one of 'constant', 'linear', "
            "'cosine', 'wsd', 'inverse_sqrt'; did you mean 'cosine'?",
        ),
        (
            ["--model.init_args.muon_config.schedule.warmup=fast"],
            "error: model.init_args.muon_config.schedule.warmup: expected float, got 'fast'",
        ),
        (["--trainer.max_stepz=3"], "error: trainer.max_stepz: no such option; did you mean 'trainer.max_steps'?"),
    ],
    ids=[
        "choice_typo",
        "unknown_section",
        "unknown_option",
        "choice_typo_in_a_config",
        "not_a_number",
        "unknown_trainer_option",
    ],
)
def test_cli_rejected_values_name_the_field_and_its_choices_in_two_lines(capsys, monkeypatch, bad, first_line):
    # In this process (parsing fails before anything is built); the subprocess's stderr is the
    # same text (test_cli_bad_input_is_reported_first_without_tracebacks).
    monkeypatch.setattr(sys, "argv", ["lightning_muon"])  # not pytest's own arguments
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", "muon", "--model.class_path=cli_user_model.UserModel", *bad])
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2
    assert lines == [first_line, TIP], lines


# --- python -m lightning_muon options [NAME], --help, --print_config ------------------------------


def _options(capsys: pytest.CaptureFixture[str], *name: str) -> str:
    assert main(["options", *name]) is None
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def _documented(text: str) -> dict[str, tuple[str, str]]:
    """Field -> (its ``type = default`` text, its doc, wrapped lines joined) from an ``options`` listing."""
    fields: dict[str, tuple[str, str]] = {}
    name = None
    for line in text.splitlines():
        field = re.match(r"^  (\w+): (.+)$", line)
        if field:
            name = field.group(1)
            fields[name] = (field.group(2), "")
        elif name is not None and line.startswith("      "):
            kind, doc = fields[name]
            fields[name] = (kind, f"{doc} {line.strip()}".strip())
        else:
            name = None
    return fields


def _same_words(a: str, b: str) -> bool:
    """Equal but for whitespace (the listing wraps docs at 100 columns, hyphenated words included)."""
    return "".join(a.split()) == "".join(b.split())


def test_options_alone_lists_the_sections_and_the_algorithms(capsys):
    text = _options(capsys)
    fields = _documented(text)
    sections = [f.name for f in dataclasses.fields(MuonConfig)]
    assert list(fields) == sections == ["matrix", "scalar", "others", "state", "routing", "schedule", "megatron"]
    assert all(doc for _, doc in fields.values()), fields
    matrix = [n for n in algorithm_names() if per_matrix(n)]
    scalar = [n for n in algorithm_names() if not per_matrix(n)]
    assert {"muon", "adaptive_muon", "scion", "soap"} <= set(matrix) and scalar == [
        "adamw",
        "lion",
        "adamw_schedulefree",
        "laprop",
    ]
    assert f"matrix algorithms: {', '.join(matrix)}" in text.splitlines()
    assert f"scalar algorithms: {', '.join(scalar)}" in text.splitlines()
    assert "sections: state, routing, schedule; Megatron-Core's names: megatron" in text.splitlines()


def test_options_muon_lists_every_setting_with_its_default_and_doc(capsys):
    text = _options(capsys, "muon")
    assert text.startswith("muon: MuonSettings (lightning_muon.algorithms.muon)\n")
    assert "In a config: muon_config.matrix: {class_path: MuonSettings, init_args: {...}}" in text
    listed = _documented(text.split("\nsettings:\n", 1)[1].split("\nalso read under", 1)[0])
    defaults, docs = MuonSettings(), MuonSettings.docs()
    assert list(listed) == list(MuonSettings.field_names())
    for name, (kind, doc) in listed.items():
        assert kind.endswith(f" = {getattr(defaults, name)!r}"), (name, kind)
        assert docs[name] and _same_words(doc, docs[name]), (name, doc)
    assert "'original', 'match_rms_adamw', 'spectral', 'spectral_norm', 'none'" in listed["adjust_lr"][0]
    # Other projects' names, each with the field it sets.
    aliases = text.split("\nalso read under other projects' names:\n", 1)[1].splitlines()
    assert aliases == [f"  {a.name} -> {a.field} ({a.source})" for a in aliases_of(MuonSettings).values()]
    assert {"num_ns_steps", "coefficient_type", "scale_mode", "adjust_lr_fn"} <= set(aliases_of(MuonSettings))


def test_options_of_a_section_and_of_megatron(capsys):
    listed = _documented(_options(capsys, "schedule"))
    assert list(listed) == [f.name for f in dataclasses.fields(ScheduleSettings)]
    assert all(doc for _, doc in listed.values()), listed
    text = _options(capsys, "megatron")
    assert text.startswith("muon_config.megatron: a Megatron-Core OptimizerConfig block (MuonConfig.from_megatron)\n")
    read, refused = text.split("\nrefused, with what to use instead:\n")
    assert "  optimizer: 'muon', 'adaptive_muon' or 'soap' (required)" in read.splitlines()
    assert [line for line in read.splitlines() if " = " in line] == [
        f"  {name} = {default!r}" for name, default in MEGATRON_DEFAULTS.items()
    ]
    assert {"muon_momentum", "muon_coefficient_type", "adam_beta2", "exp_avg_dtype"} <= set(MEGATRON_DEFAULTS)
    assert refused.splitlines() == [f"  {name}: {advice}" for name, advice in MEGATRON_REFUSED.items()]
    assert "  decoupled_lr: a routing Rule whose options set lr for the embedding and the head" in refused


def test_options_of_an_unknown_name_exits_2_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["options", "muonn"])
    captured = capsys.readouterr()
    assert exited.value.code == 2 and captured.out == ""
    known = [*algorithm_names(), "state", "routing", "schedule", "megatron"]
    assert captured.err == (
        f"error: options: 'muonn' is neither an algorithm nor a section; one of {known}; did you mean 'muon'?\n"
    )
    assert {"muon", "adamw", "soap", "laprop"} <= set(known)


def test_options_and_help_from_the_command_line(tmp_path):
    # ``options`` itself is tested in this process above; here the command line's help names it.
    proc = _cli(tmp_path, "--help", fresh=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    commands = proc.stdout.split("\nmore commands:\n", 1)[1].splitlines()
    assert [line.split(":")[0] for line in commands] == [
        "  python -m lightning_muon convert-checkpoint DIR OUT.ckpt",
        "  python -m lightning_muon options [NAME]",
    ]
    assert "Available subcommands:" in proc.stdout and re.search(r"^\s+fit\s", proc.stdout, re.M)


def _leaves(value: object) -> int:
    """The keys with a value of their own: every scalar, list item or empty container."""
    if isinstance(value, dict):
        return sum(_leaves(v) for v in value.values()) or 1
    if isinstance(value, list):
        return sum(_leaves(v) for v in value) or 1
    return 1


def test_print_config_holds_only_the_chosen_algorithms_settings_each_documented(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning_muon"])
    with pytest.raises(SystemExit) as exited:
        main(["fit", "-c", "muon", "--print_config"])
    assert exited.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["muon_config"]
    optimizer = {name: config[name] for name in ("matrix", "scalar", "others", "state", "megatron")}
    # Muon's settings and AdamW's, not every algorithm's (the flat config printed well over 100).
    assert _leaves(optimizer) < 50, optimizer
    assert (config["matrix"]["class_path"], config["scalar"]["class_path"]) == (
        "lightning_muon.MuonSettings",
        "lightning_muon.AdamWSettings",
    )
    for section, algorithm in (("matrix", "muon"), ("scalar", "adamw")):
        documented = _documented(_options(capsys, algorithm))
        for key in config[section]["init_args"]:
            assert key in documented and documented[key][1], f"{section}.init_args.{key}: no doc in options {algorithm}"
