"""The algorithm registry: the built-ins, its checks, and a user's algorithm from a file outside the package.

``tests/user_algorithm.py`` is that file: Signum, registered as ``"signum"``. It is imported
inside the tests (``signum`` fixture), never at collection: the registry is restored after
every test (conftest.py), so other tests see the built-in algorithms only.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from test_cli import _cli, _routing_table
from torch import nn

from lightning_muon import (
    Algorithm,
    Muon,
    MuonConfig,
    MuonHyperballSettings,
    MuonModuleMixin,
    MuonSettings,
    RoutingSettings,
    Rule,
    SOAPSettings,
    register_algorithm,
    route_parameters,
)
from lightning_muon.algorithms import (
    AdamWSettings,
    AdaptiveMuonSettings,
    ScalarSettings,
    StepContext,
    algorithm_names,
    get_algorithm,
    orthogonalizes,
)

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def signum():
    """``user_algorithm`` imported (or registered again: the registry was restored since the first import)."""
    module = importlib.import_module("user_algorithm")
    if "signum" not in algorithm_names():
        register_algorithm(module.Signum)
    return module


def _signum64(W0: torch.Tensor, grads: list[torch.Tensor], lr: float, beta: float, wd: float) -> torch.Tensor:
    W, m = W0.double(), torch.zeros_like(W0, dtype=torch.float64)
    for g in grads:
        m = beta * m + (1 - beta) * g.double()
        W = W * (1 - lr * wd) - lr * torch.sign(m)
    return W


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))) * self.gain)


# ------------------------------------------------------------------ the registry


def test_the_builtins_are_registered_in_order_and_muon_alone_orthogonalizes():
    assert algorithm_names()[:5] == ("muon", "adamw", "lion", "adamw_schedulefree", "muon_hyperball")
    assert algorithm_names(orthogonal=False) == ("adamw", "lion", "adamw_schedulefree", "laprop", "soap", "rekls")
    # The hidden matrices' algorithms: Muon's family, and SOAP's, whose eigenbases are whole-matrix work too.
    orthogonal = ("muon", "muon_hyperball", "adaptive_muon", "scion", "polargrad", "mop", "spel", "sinkhorn_muon")
    assert algorithm_names(orthogonal=True) == orthogonal
    assert algorithm_names(matrix=True) == (*orthogonal, "soap", "rekls")
    assert algorithm_names(matrix=False) == ("adamw", "lion", "adamw_schedulefree", "laprop")
    assert [orthogonalizes(n) for n in ("muon", "adamw", "lion", "adamw_schedulefree")] == [True, False, False, False]
    assert not orthogonalizes({"params": []}) and not orthogonalizes("sgd")  # another optimizer's group
    with pytest.raises(ValueError, match=r"algorithm must be one of \('muon', .*\), got 'sgd' \(an algorithm of"):
        get_algorithm("sgd")
    with pytest.raises(ValueError, match=r"algorithm 'no_such_module.Rule' cannot be imported"):
        get_algorithm("no_such_module.Rule")
    with pytest.raises(ValueError, match=r"algorithm 'torch.nn.Linear' is .*, not an Algorithm subclass or instance"):
        get_algorithm("torch.nn.Linear")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Knobs(ScalarSettings):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Clash(ScalarSettings):
    params: float = 0.0
    """A setting named like a group key."""


class _Step(Algorithm):
    settings = _Knobs

    def step_group(self, optimizer, group, params, grads):
        torch._foreach_add_(params, grads, alpha=-group["lr"])


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: type("A", (_Step,), {"name": "adamw"}), ValueError, r"'adamw' is registered already"),
        (lambda: type("A", (_Step,), {"name": "has space"}), ValueError, r"A.name must be an identifier"),
        (lambda: type("A", (Algorithm,), {"name": "nostep", "settings": _Knobs}), ValueError, r"does not define step"),
        (lambda: type("A", (_Step,), {"name": "plain", "settings": dict}), TypeError, r"settings must be a dataclass"),
        (
            lambda: type("A", (_Step,), {"name": "plainer", "settings": dataclasses.make_dataclass("K", ["lr"])}),
            TypeError,
            r"deriving from lightning_muon.algorithms.Settings",
        ),
        (
            lambda: type("A", (_Step,), {"name": "clash", "settings": _Clash}),
            ValueError,
            r"settings \['params'\] are reserved group keys",
        ),
        (lambda: torch.optim.SGD, TypeError, r"expected an Algorithm or a subclass of it"),
    ],
)
def test_register_algorithm_refuses_what_cannot_work(make, error, match):
    with pytest.raises(error, match=match):
        register_algorithm(make())


def test_register_algorithm_replaces_on_request_only():
    first = register_algorithm(type("A", (_Step,), {"name": "steepest"}))
    assert type(get_algorithm("steepest")) is first
    second = register_algorithm(type("B", (_Step,), {"name": "steepest"}), replace=True)
    assert type(get_algorithm("steepest")) is second


# ------------------------------------------------------------------ a user's algorithm


def test_a_users_algorithm_steps_its_groups_by_its_formula_and_resumes(signum):
    torch.manual_seed(0)
    shapes = [(5, 3), (4,)]
    W0 = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(6)]
    params = [nn.Parameter(w.clone()) for w in W0]
    opt = Muon([{"params": params, "algorithm": "signum", "beta": 0.8, "weight_decay": 0.1}], lr=0.02)
    assert opt.param_groups[0]["lr"] == 1e-3  # Signum's own default, not Muon's lr
    assert opt.param_groups[0]["momentum"] == 0.8  # its read-out for LearningRateMonitor
    for step in grads[:3]:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = Muon([{"params": resumed_params, "algorithm": "signum", "beta": 0.8, "weight_decay": 0.1}])
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for o, ps in ((opt, params), (resumed, resumed_params)):
        for step in grads[3:]:
            for p, g in zip(ps, step):
                p.grad = g.clone()
            o.step()
    for i, (p, q) in enumerate(zip(params, resumed_params)):
        want = _signum64(W0[i], [g[i] for g in grads], lr=1e-3, beta=0.8, wd=0.1)
        torch.testing.assert_close(p.detach().double(), want, atol=1e-6, rtol=0)
        assert torch.equal(p, q)
    assert set(opt.state[params[0]]) == {"momentum_buffer"}


def test_a_users_algorithm_is_checked_and_named_in_rules(signum):
    model = Tiny()
    rule = Rule(name="gains", algorithm="signum", names="gain", options={"beta": 0.5})
    groups = route_parameters(model, rules=[rule])
    assert {g["name"]: g["algorithm"] for g in groups}["gains"] == "signum"
    signum_settings = signum.SignumSettings
    opt = Muon(groups, settings=[signum_settings(lr=0.05)])
    gains = next(g for g in opt.param_groups if g["name"] == "gains")
    assert (gains["lr"], gains["beta"], gains["weight_decay"]) == (0.05, 0.5, 0.0)
    with pytest.raises(ValueError, match=r"option 'bta' is not a hyperparameter of 'signum' groups; did you mean"):
        Rule(name="r", algorithm="signum", options={"bta": 0.5})
    with pytest.raises(ValueError, match=r"param group 0 \('g'\): beta must be a finite number in \[0.0, 1.0\)"):
        Muon([{"params": [model.gain], "algorithm": "signum", "name": "g", "beta": 1.5}])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bta'"):
        signum_settings(bta=0.5)
    with pytest.raises(ValueError, match=r"Muon: settings holds AdamWSettings and the keywords .* set adamw's"):
        Muon([model.gain], adamw_lr=1e-2, settings=[AdamWSettings(eps=1e-6)])
    with pytest.raises(ValueError, match=r"two settings for 'signum'"):
        Muon([model.gain], settings=[signum_settings(), signum_settings(lr=1.0)])
    # An import path names it too, and reaches the registered instance.
    assert get_algorithm("user_algorithm.Signum") is get_algorithm("signum")


def test_a_users_algorithm_replaces_adamw_under_the_default_rules(signum):
    groups = route_parameters(Tiny(), scalar_algorithm="user_algorithm.Signum")
    assert {g["name"]: g["algorithm"] for g in groups} == {
        "signum_no_decay": "signum", "signum": "signum", "muon": "muon"
    }  # fmt: skip
    # The default vectors rule's weight_decay=0 is kept: Signum has the knob.
    assert next(g for g in groups if g["name"] == "signum_no_decay")["weight_decay"] == 0.0
    with pytest.raises(ValueError, match=r"scalar_algorithm must be one of .*'signum'\), got 'muon'"):
        route_parameters(Tiny(), scalar_algorithm="muon")
    with pytest.raises(ValueError, match=r"matrix_algorithm must be one of \('muon'.*\), got 'signum'"):
        route_parameters(Tiny(), matrix_algorithm="signum")


class YamlModel(MuonModuleMixin, pl.LightningModule):
    def __init__(self, muon_config: MuonConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = Tiny()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=gen), torch.randn(32, 1, generator=gen))
        return torch.utils.data.DataLoader(data, batch_size=8)


CONFIG_YAML = """
routing:
  rules:
    - name: gains
      algorithm: signum
      names: "*.gain"
      options: {beta: 0.5}
others:
  - class_path: user_algorithm.SignumSettings
    init_args: {lr: 0.01}
matrix:
  init_args: {ns_dtype: float32}
"""


@pytest.mark.filterwarnings(
    "ignore:.*does not have many workers", "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"
)
def test_a_users_algorithm_named_in_yaml_trains_under_lightning(signum, tmp_path):
    config = MuonConfig.from_any(yaml.safe_load(CONFIG_YAML))
    model = YamlModel(config)
    before = model.net.gain.detach().clone()
    trainer = pl.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model)
    opt = trainer.optimizers[0]
    gains = next(g for g in opt.param_groups if g["name"] == "gains")
    assert (gains["algorithm"], gains["beta"]) == ("signum", 0.5)
    assert set(opt.state[model.net.gain]) == {"momentum_buffer"}
    moved = (model.net.gain.detach() - before).abs()
    # Sign descent: every entry moved by a multiple of the scheduled lr, at most 4 steps' worth.
    assert 0 < moved.max().item() <= 4 * 0.01 + 1e-6
    assert MuonConfig.from_any(config.to_dict()) == config


def test_the_cli_trains_with_an_algorithm_a_yaml_names_by_import_path(tmp_path):
    """In a fresh process nothing imported user_algorithm: the config's import path does."""
    config = tmp_path / "signum.yaml"
    config.write_text(
        textwrap.dedent(
            """
            trainer: {max_steps: 3, limit_val_batches: 0, enable_progress_bar: false, logger: false}
            model:
              class_path: cli_user_model.UserModel
              init_args:
                muon_config:
                  scalar:
                    class_path: user_algorithm.SignumSettings
                    init_args: {lr: 0.01}
                  matrix:
                    init_args: {ns_dtype: float32}
            """
        )
    )
    proc = _cli(tmp_path, "fit", f"--config={config}", f"--trainer.default_root_dir={tmp_path}", pythonpath=TESTS)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert _routing_table(output) == {"signum": ("signum", 1), "signum_no_decay": ("signum", 3), "muon": ("muon", 2)}


def test_with_lr_moves_a_registered_algorithms_own_lr_and_leaves_hyperball_on_muons(signum):
    # The lr finder's suggestion becomes a config by MuonConfig.with_lr: an algorithm with an
    # lr of its own keeps its ratio to the Muon lr, whether a rule names it or its defaults do.
    by_rule = MuonConfig(
        matrix=MuonSettings(lr=0.02),
        routing=RoutingSettings(rules=[Rule(name="signs", algorithm="user_algorithm.Signum", names="*.bias")]),
    )
    assert by_rule.with_lr(0.04).settings_of("signum").lr == pytest.approx(2e-3, rel=1e-15)
    given = MuonConfig(matrix=MuonSettings(lr=0.02), scalar=signum.SignumSettings(lr=5e-4, beta=0.8))
    tuned = given.with_lr(0.01)
    assert tuned.scalar == signum.SignumSettings(lr=2.5e-4, beta=0.8, weight_decay=0.0)
    assert given.scalar.lr == 5e-4  # the original untouched
    hyperball = MuonConfig(matrix=MuonHyperballSettings(lr=0.02)).with_lr(0.01)
    assert hyperball.settings_of("muon_hyperball").lr == 0.01


# ------------------------------------------------------------------ the step context and the flat keywords


def test_a_step_sees_the_optimizer_only_through_its_step_context():
    """``step_group`` gets the StepContext: state, settings, sharding, hooks, and none of Muon's own methods."""
    seen = []

    class _Probe(Algorithm):
        name = "probe_context"
        settings = _Knobs

        def step_group(self, ctx, group, params, grads):
            seen.append(ctx)
            ctx.state[params[0]]["calls"] = ctx.state[params[0]].get("calls", 0) + 1

    register_algorithm(_Probe(), replace=True)
    w = nn.Parameter(torch.ones(3))
    opt = Muon([{"params": [w], "algorithm": "probe_context"}], step_memory_mb=8)
    w.grad = torch.ones(3)
    opt.step()
    opt.step()
    ctx = seen[0]
    assert type(ctx) is StepContext and seen[1] is ctx  # one per optimizer
    assert opt.state[w]["calls"] == 2 and ctx.state_settings.step_memory_mb == 8 and ctx.sharding is None
    assert not ctx.has_update_hooks and ctx.group_index(opt.param_groups[0]) == 0
    for name in ("step", "param_groups", "add_param_group", "finite_checks", "attach_sharding"):
        assert not hasattr(ctx, name), name


def test_an_algorithms_settings_reach_its_groups_from_the_config_and_from_muon():
    """A matrix section's settings reach its groups; ``Muon(settings=[...])`` gives other algorithms' defaults."""
    w = nn.Parameter(torch.randn(4, 6))
    config = MuonConfig(matrix=SOAPSettings(shampoo_beta=0.9, use_kl_shampoo=True))
    optimizer, _ = config.build(nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 4)))
    soap = [g for g in optimizer.param_groups if g["algorithm"] == "soap"]
    assert soap and all(g["shampoo_beta"] == 0.9 and g["use_kl_shampoo"] for g in soap)
    given = Muon([w], settings=[AdaptiveMuonSettings(second_moment_beta2=0.9)])
    assert given.settings_of("adaptive_muon").second_moment_beta2 == 0.9
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'soap_shampoo_beta'"):
        Muon([w], soap_shampoo_beta=0.9)
