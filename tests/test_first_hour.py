"""The first hour with the tools people bring: each case written as a new user writes it.

A config given to ``__init__`` without ``save_hyperparameters()``; ``Muon(model.named_parameters())``
on a transformers Llama and BERT; torch's schedulers on the hybrid; a logger's
``hparams.yaml`` read back; peft's LoRA and trainable tokens; ``torch.compile`` of a
submodule; LightningCLI's ``--optimizer``; the smaller messages. Each either does what was
asked or says what happened and the line that does it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from dist_utils import run_main
from torch import nn

from lightning_muon import (
    AdamWSettings,
    Muon,
    MuonConfig,
    MuonModuleMixin,
    MuonSettings,
    QKClip,
    RoutingSettings,
    Rule,
    route_parameters,
)
from lightning_muon.cli import main
from lightning_muon.options import main as options_main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.policy_free  # see conftest.py


def _llama(**kwargs):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, **kwargs,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _bert_classifier():
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _algorithm_of(opt: torch.optim.Optimizer) -> dict[str, str]:
    return {n: g["algorithm"] for g in opt.param_groups for n in g["param_names"]}


def _group_of(opt: torch.optim.Optimizer) -> dict[str, str]:
    return {n: g["name"] for g in opt.param_groups for n in g["param_names"]}


# ------------------------------------------------------------------ 1. a config given to __init__


class NoSave(MuonModuleMixin, pl.LightningModule):
    """The mixin's example without ``self.save_hyperparameters()``."""

    def __init__(self, muon_config: MuonConfig | None = None, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 2))


def _lrs(module: pl.LightningModule) -> dict[str, float]:
    optimizer = module.configure_optimizers()["optimizer"]
    return {g["name"]: g["lr"] for g in optimizer.param_groups}


def test_a_config_given_to_init_without_save_hyperparameters_is_the_one_trained_with():
    config = MuonConfig(matrix=MuonSettings(lr=0.1), scalar=AdamWSettings(lr=1e-2))
    assert _lrs(NoSave(config)) == {"muon": 0.1, "adamw": 1e-2, "adamw_no_decay": 1e-2}
    assert _lrs(NoSave(muon_config=config, width=4)) == {"muon": 0.1, "adamw": 1e-2, "adamw_no_decay": 1e-2}
    # As LightningCLI gives it: a dict of the config's fields.
    assert _lrs(NoSave(muon_config={"matrix": {"lr": 0.05}}))["muon"] == 0.05
    assert _lrs(NoSave())["muon"] == MuonSettings().lr  # none given: the defaults


class Parent(MuonModuleMixin, pl.LightningModule):
    def __init__(self, muon_config: MuonConfig | None = None, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(width, width)


class Child(Parent):
    def __init__(self, depth: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)


def test_save_hyperparameters_still_collects_every_init_of_the_chain():
    child = Child(depth=5, width=4, muon_config=MuonConfig(matrix=MuonSettings(lr=0.07)))
    assert child.hparams["depth"] == 5 and child.hparams["width"] == 4
    assert child.resolve_muon_config().matrix.lr == 0.07


# ------------------------------------------------------------------ 2. named parameters, routed by name


def test_named_parameters_of_a_llama_send_embeddings_head_and_norms_to_adamw():
    model = _llama()
    opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4)
    algorithm, group = _algorithm_of(opt), _group_of(opt)
    assert algorithm["model.embed_tokens.weight"] == "adamw" and algorithm["lm_head.weight"] == "adamw"
    assert group["model.norm.weight"] == "adamw_no_decay"
    assert algorithm["model.layers.0.self_attn.q_proj.weight"] == "muon"
    assert algorithm["model.layers.1.mlp.down_proj.weight"] == "muon"
    # The same groups as the module's own routing (the mixin's), tensor for tensor.
    routed = {n: g["name"] for g in route_parameters(model) for n in g["param_names"]}
    assert group == routed


def test_named_parameters_of_a_bert_classifier_send_its_embeddings_and_classifier_to_adamw():
    model = _bert_classifier()
    opt = Muon(model.named_parameters())
    algorithm = _algorithm_of(opt)
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        assert algorithm[f"bert.embeddings.{name}.weight"] == "adamw"
    assert algorithm["classifier.weight"] == "adamw"
    assert algorithm["bert.encoder.layer.0.attention.self.query.weight"] == "muon"
    assert algorithm["bert.encoder.layer.1.output.dense.weight"] == "muon"  # "output" inside a block: no head
    assert algorithm["bert.pooler.dense.weight"] == "muon"


def test_unnamed_parameters_of_a_whole_model_keep_the_flat_rule_and_say_how_to_route():
    model = _llama()
    with pytest.warns(UserWarning, match=r"without names.*named_parameters\(\)") as caught:
        opt = Muon(model.parameters())
    assert "embeddings and output heads" in str(caught[0].message)
    assert [g["name"] for g in opt.param_groups] == ["muon", "adamw"]
    # Matrices alone (torch.optim.Muon's way): what was asked, nothing to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([p for p in model.parameters() if p.ndim == 2])


def test_lightning_cli_optimizer_without_the_mixin_warns_naming_the_routed_way(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16)

    args = ["--optimizer=lightning_muon.Muon", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.warns(UserWarning, match="LightningCLI's --optimizer.*MuonModuleMixin"):
        LightningCLI(Plain, run=False, args=args, save_config_callback=None)  # it makes the optimizer


# ------------------------------------------------------------------ 3. torch's schedulers on the hybrid


def test_one_cycle_lr_cycles_adamws_beta1_as_on_torch_adamw():
    torch.manual_seed(0)
    w, b = torch.randn(6, 6), torch.randn(6)
    ours = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    theirs = [b.clone().requires_grad_()]
    groups = [{"params": ours[:1]}, {"params": ours[1:], "algorithm": "adamw", "lr": 1e-3}]
    opt = Muon(groups, lr=0.02, ns_dtype="float32")
    adamw = opt.param_groups[1]
    ref = torch.optim.AdamW(theirs, lr=1e-3, betas=adamw["betas"], eps=adamw["eps"], weight_decay=adamw["weight_decay"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 1e-3], total_steps=8)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=1e-3, total_steps=8)
    for _ in range(6):
        g = torch.randn(6)
        ours[0].grad, ours[1].grad, theirs[0].grad = torch.randn(6, 6), g.clone(), g.clone()
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    # The scheduler writes the next step's beta1 in "momentum"; the step takes it into betas.
    assert opt.param_groups[1]["momentum"] == ref.param_groups[0]["betas"][0] != 0.9
    torch.testing.assert_close(ours[1], theirs[0], rtol=0, atol=0)


def test_a_scalar_max_lr_puts_every_group_at_one_lr_and_warns_with_the_line_that_keeps_them():
    model = _llama()
    opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4, ns_dtype="float32")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.warns(UserWarning, match=r"one lr .*max_lr=\[g\[\"lr\"\] for g in optimizer.param_groups\]"):
        opt.step()
    sched.step()
    with warnings.catch_warnings():  # once
        warnings.simplefilter("error")
        opt.step()


def test_swalr_with_one_swa_lr_warns_when_the_groups_meet():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-4, ns_dtype="float32")
    swa = torch.optim.swa_utils.SWALR(opt, swa_lr=0.01, anneal_epochs=2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.warns(UserWarning, match="SWALR"):
        for _ in range(3):
            opt.step()
            swa.step()


class PlainLM(pl.LightningModule):
    """No mixin: its own configure_optimizers with Muon on named parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.02
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return nn.functional.cross_entropy(self.head(torch.relu(self.hidden(self.embed(x)))), x)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 16, (64,))), batch_size=4)

    def configure_optimizers(self):
        return Muon(self.named_parameters(), lr=self.lr, adamw_lr=3e-4, ns_dtype="float32")


def test_lr_find_without_the_mixin_warns_that_it_sweeps_every_group_at_one_lr(tmp_path):
    from lightning.pytorch.tuner import Tuner

    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, max_epochs=1)
    with pytest.warns(UserWarning, match="lr_find"):
        Tuner(trainer).lr_find(PlainLM(), min_lr=1e-4, max_lr=1e-1, num_training=5, update_attr=False)


# ------------------------------------------------------------------ 4. hparams.yaml read back


class Saved(MuonModuleMixin, pl.LightningModule):
    def __init__(self, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)


def test_a_loggers_hparams_yaml_is_plain_yaml_and_loads_the_checkpoint(tmp_path):
    config = MuonConfig(
        matrix=MuonSettings(lr=0.03),
        routing=RoutingSettings(rules=[Rule(name="first", names="net.0.*", algorithm="adamw")]),
    )
    logger = pl.loggers.CSVLogger(tmp_path)
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=logger, max_steps=2, enable_progress_bar=False)
    trainer.fit(Saved(config))
    hparams_file = Path(logger.log_dir) / "hparams.yaml"
    text = hparams_file.read_text()
    assert "!!python" not in text, text
    saved = yaml.safe_load(text)["muon_config"]
    assert MuonConfig.from_any(saved) == config
    ckpt = next(tmp_path.rglob("*.ckpt"))
    loaded = Saved.load_from_checkpoint(ckpt, hparams_file=hparams_file)
    assert loaded.resolve_muon_config() == config


# ------------------------------------------------------------------ 6. peft


def test_peft_lora_on_an_embedding_and_trainable_tokens_go_to_adamw_and_lora_a_b_to_muon():
    peft = pytest.importorskip("peft", reason="peft is a dev dependency; it installs with torch pinned")
    lora = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"]))
    tokens = peft.get_peft_model(
        _llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[1, 2])
    )
    for model in (lora, tokens):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        for algorithm in (_algorithm_of(Muon(model.named_parameters())), _algorithm_of(Muon(route_parameters(model)))):
            for name in trainable:
                chosen = algorithm[name]
                embedding = "lora_embedding_" in name or "trainable_tokens_delta" in name
                assert chosen == ("adamw" if embedding else "muon"), name


# ------------------------------------------------------------------ 7. torch.compile of a submodule


class CompiledInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        self.head = nn.Linear(4, 2)


def test_a_rule_names_a_compiled_submodules_parameters_as_written():
    model = CompiledInside()
    assert "body._orig_mod.1.weight" in dict(model.named_parameters())
    rules = [Rule(name="last_body", names="body.1.weight", algorithm="adamw")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule matches: no "matches no tensor"
        groups = route_parameters(model, rules=rules)
    assert groups.assignments["body._orig_mod.1.weight"] == "last_body"


# ------------------------------------------------------------------ 8, 5, 9. the package CLI

QUICK = ["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]


def _cli_error(capsys, monkeypatch, *args: str) -> list[str]:
    monkeypatch.setattr(sys, "argv", ["lightning_muon"])
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()


def test_the_package_cli_refuses_optimizer_with_a_mixin_model_naming_what_it_would_drop(capsys, monkeypatch):
    lines = _cli_error(capsys, monkeypatch, "fit", "--config=muon", "--optimizer=torch.optim.AdamW", *QUICK)
    assert lines[0].startswith("error: --optimizer would replace CharGPTModule.configure_optimizers"), lines
    assert "model.init_args.muon_config" in lines[0]


def test_trainer_logger_false_runs_a_bundled_config_without_its_lr_monitor(tmp_path):
    args = ["fit", "--config=muon", "--trainer.logger=false", *QUICK, "--data.init_args.max_chars=20000"]
    args.append("--model.init_args.muon_config.matrix.init_args.ns_dtype=float32")  # a policy_free module
    proc = run_main("lightning_muon", args, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "LearningRateMonitor left out: --trainer.logger=false" in proc.stderr
    assert "`max_steps=2` reached" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        (
            ["--config=muonn"],
            "error: argument -c/--config: 'muonn' is neither a file nor a bundled config "
            "(bundled: adamw, muon, muon_ddp, muon_fsdp, muon_schedulefree); did you mean 'muon'?",
        ),
        (
            ["--config=muon", "--config", "model: {init_args: {muon_config: {shedule: {warmup: 3}}}}"],
            "error: model.init_args.muon_config.shedule: MuonConfig has no option 'shedule'; did you mean 'schedule'?",
        ),
        (  # build-time errors come first, before Lightning's "Seed set to 0"
            ["--config=muon", "--model.init_args.muon_config.matrix.init_args.momentum=1.5"],
            "error: MuonSettings.momentum must be a finite number in [0.0, 1.0), got 1.5",
        ),
        (
            ["--config=muon", "--model.init_args.muon_config.matrix.init_args.lr=abc"],
            "error: MuonConfig.matrix: lr must be a finite number in [0.0, inf), got 'abc'",
        ),
    ],
    ids=["config_typo", "section_typo_in_yaml", "momentum", "lr_abc"],
)
def test_cli_errors_come_first_with_the_nearest_name(tmp_path, args, first_line):
    # A process of its own: Lightning logs "Seed set to 0" to the process's stderr.
    proc = run_main("lightning_muon", ["fit", *args, *QUICK], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[0] == first_line, proc.stderr[-3000:]


def test_a_section_typo_in_a_config_dict_names_the_nearest():
    # The form save_hyperparameters keeps and LightningCLI passes: a dict of the sections.
    with pytest.raises(ValueError, match=r"unknown sections \['shedule'\]; did you mean 'schedule'\?"):
        NoSave(muon_config={"shedule": {"warmup": 3}}).resolve_muon_config()


def test_options_of_a_typo_names_the_nearest(capsys):
    assert options_main(["mun"], prog="options") == 2
    assert "did you mean 'muon'?" in capsys.readouterr().err


def test_a_single_tensor_as_params_gets_torchs_words():
    with pytest.raises(TypeError, match=r"^params argument given to the optimizer should be an iterable of Tensors or "
                       r"dicts, but got torch.FloatTensor$"):  # fmt: skip
        Muon(torch.zeros(2, 2))


class _QKModule(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_qk_clip_on_a_peft_lora_llama_says_why_and_what_to_do():
    peft = pytest.importorskip("peft", reason="peft is a dev dependency; it installs with torch pinned")
    model = peft.get_peft_model(_llama(attn_implementation="sdpa"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"LoRA.*merge_and_unload") as err:
        QKClip(threshold=100.0).on_fit_start(None, _QKModule(model))
    assert "use a transformers model" not in str(err.value)
