"""Other projects' names for our settings, in one table, applied wherever settings are read.

Our settings have one name each (``algorithms.families``). Three projects spell some of them
otherwise, and their users' configs load here as written:

- NVIDIA Emerging-Optimizers 0.3.0's constructor keywords: ``num_ns_steps``,
  ``coefficient_type``, ``scale_mode`` (any Newton-Schulz algorithm), and ``AdaptiveMuon``'s
  ``moment2_method``, ``beta2``, ``eps``;
- ``torch.optim.Muon``'s keywords ``adjust_lr_fn`` and ``eps`` (``ns_eps``; on ``"muon"`` settings only, so
  that AdamW's own ``eps`` and AdaptiveMuon's alias of that name keep their meanings);
- Megatron-Core's ``OptimizerConfig`` names (``optimizer``, ``muon_momentum``, ``adam_beta1``,
  ``soap_shampoo_beta``, ...): a Megatron optimizer block, read whole by ``megatron_sections``
  (``MuonConfig.from_megatron``), since one of its names may set several of ours (``lr`` is every
  group's) and its defaults are Megatron's.

The first two apply to a settings dict, a param group or a routing rule's options
(``canonical``): an alias is renamed to its field, its value converted (``coefficient_type``
names a schedule over ``num_ns_steps`` steps), and an alias given beside its field with
another value is an error naming both. Errors name the alias as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.families import NewtonSchulzSettings, OrthogonalizedSettings
from lightning_muon.algorithms.settings import Settings
from lightning_muon.newton_schulz import COEFFICIENTS

__all__ = [
    "ALIASES",
    "EO_COEFFICIENT_TYPES",
    "MEGATRON_COEFFICIENTS",
    "MEGATRON_REFUSED",
    "SCALE_MODES",
    "Alias",
    "aliases_of",
    "canonical",
    "canonical_with_aliases",
    "eo_schedule",
    "megatron_sections",
    "named_as_written",
    "settings_from",
]

# Emerging-Optimizers' ``coefficient_type`` names (Megatron-Core's ``muon_coefficient_type``) and
# their schedules here. Emerging-Optimizers cycles "quintic" and "aol" when there are more
# steps than tuples (``eo_schedule``); the others repeat their last tuple, as ours do.
MEGATRON_COEFFICIENTS: dict[str, str | list[tuple[float, float, float]]] = {
    "simple": "keller",  # (3.4445, -4.7750, 2.0315) at every step
    "quintic": "you",  # Megatron's default, You Jiacheng's 5-step tuning
    # The paper's 8 tuples with the 1.01 safety folded in (Megatron rounds them to 4 digits),
    # pre-scaled by ||X||_F; our "polar_express_paper" is the same list at full precision,
    # pre-scaled by 1.01 ||X||_F. Megatron requires num_ns_steps >= 8.
    "polar_express": "polar_express_megatron",
    "cans": "cans",  # Grishina et al., arXiv 2506.10935
    "deepseekv4": "deepseekv4",  # 10 steps: Keller's quintic 8 times, then (2, -1.5, 0.5) twice
    # Megatron's "aol" list, from thib-s/flash-newton-schulz (Boissin et al.), 4 tuples.
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
EO_COEFFICIENT_TYPES = tuple(MEGATRON_COEFFICIENTS)
# Megatron-Core's and Emerging-Optimizers' ``scale_mode`` names, by our ``adjust_lr``.
# MOP's "nuclear_norm" is ours too (``MOPSettings``).
SCALE_MODES = {
    "shape_scaling": "original",
    "spectral": "spectral",
    "unit_rms_norm": "spectral_norm",
    "nuclear_norm": "nuclear_norm",
}
# torch.optim.Muon's ``adjust_lr_fn`` (None: its default, "original").
TORCH_ADJUST_LR = {None: "original", "original": "original", "match_rms_adamw": "match_rms_adamw"}


def eo_schedule(coefficient_type: str, num_ns_steps: int) -> str | list[tuple[float, float, float]]:
    """Our Newton-Schulz schedule for Emerging-Optimizers' ``coefficient_type`` over ``num_ns_steps`` steps."""
    schedule = MEGATRON_COEFFICIENTS[coefficient_type]
    if coefficient_type in ("quintic", "aol"):
        cycle = list(COEFFICIENTS[schedule]) if isinstance(schedule, str) else list(schedule)
        if num_ns_steps > len(cycle):
            return [tuple(cycle[i % len(cycle)]) for i in range(num_ns_steps)]
    return schedule


@dataclass(frozen=True)
class Alias:
    """Another project's ``name`` for our ``field`` of the settings of ``scope`` (a family's base or an algorithm)."""

    name: str
    field: str
    scope: type[Settings] | str
    source: str
    """Whose name it is, possessive ("Emerging-Optimizers'")."""
    convert: Callable[[Any, Mapping[str, Any], type[Settings]], Any] | None = None
    """``(value, the other values given, the settings class) -> our value``; raises ``ValueError`` naming
    what it accepts. None: the value as given."""

    def applies_to(self, cls: type[Settings]) -> bool:
        return cls.algorithm == self.scope if isinstance(self.scope, str) else issubclass(cls, self.scope)


def _choice(table: Mapping[Any, Any]) -> Callable[[Any, Mapping[str, Any], type], Any]:
    def convert(value: Any, values: Mapping[str, Any], cls: type) -> Any:
        if value not in table:
            raise ValueError(f"must be one of {tuple(table)}, got {value!r}")
        return table[value]

    return convert


def _schedule(value: Any, values: Mapping[str, Any], cls: type) -> Any:
    if value == "custom":  # the coefficients are given beside it
        given = values.get("ns_coefficients")
        if given is None or isinstance(given, str):
            raise ValueError("'custom' needs ns_coefficients as a list of (a, b, c), one per step")
        return given
    if value not in MEGATRON_COEFFICIENTS:
        raise ValueError(f"must be one of {(*EO_COEFFICIENT_TYPES, 'custom')}, got {value!r}")
    steps = values.get("ns_steps", values.get("num_ns_steps", cls.__dataclass_fields__["ns_steps"].default))
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return MEGATRON_COEFFICIENTS[value]  # a bad ns_steps is refused by its own check
    return eo_schedule(value, steps)


_EO, _TORCH = "Emerging-Optimizers'", "torch.optim.Muon's"
ALIASES: tuple[Alias, ...] = (
    Alias("num_ns_steps", "ns_steps", NewtonSchulzSettings, _EO),
    Alias("coefficient_type", "ns_coefficients", NewtonSchulzSettings, _EO, _schedule),
    Alias("scale_mode", "adjust_lr", OrthogonalizedSettings, _EO, _choice(SCALE_MODES)),
    Alias("moment2_method", "second_moment", "adaptive_muon", _EO),
    Alias("beta2", "second_moment_beta2", "adaptive_muon", _EO),
    Alias("eps", "second_moment_eps", "adaptive_muon", _EO),
    Alias("adjust_lr_fn", "adjust_lr", "muon", _TORCH, _choice(TORCH_ADJUST_LR)),
    Alias("eps", "ns_eps", "muon", _TORCH),
)


def aliases_of(cls: type[Settings]) -> dict[str, Alias]:
    """The aliases that apply to ``cls``'s fields, by name."""
    return {a.name: a for a in ALIASES if a.applies_to(cls) and a.field in cls.__dataclass_fields__}


def canonical(cls: type[Settings], values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with every alias of ``cls`` renamed to its field and converted; other keys as given.

    Raises ``HparamError`` (naming the alias as written) for a value the alias's source does not
    accept, or for an alias and its field both given with different values.
    """
    return _canonical(cls, values, where)[0]


def canonical_with_aliases(
    cls: type[Settings], values: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, Alias]]:
    """``canonical``, and the aliases used, by the field each set (``named_as_written`` reads them)."""
    return _canonical(cls, values, where)


def named_as_written(err: HparamError, used: Mapping[str, Alias], where: str) -> HparamError:
    """``err`` about a field that an alias set, told about the alias instead (itself otherwise)."""
    alias = used.get(err.field)
    if alias is None:
        return err
    return _alias_error(where, alias, err.detail.removeprefix(f"{err.field} "))


def _canonical(cls: type[Settings], values: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Alias]]:
    """``canonical``, and the aliases used, by the field each set."""
    table = aliases_of(cls)
    used = {name: alias for name, alias in table.items() if name in values}
    if not used:
        return dict(values), {}
    out = {k: v for k, v in values.items() if k not in table}
    for name, alias in used.items():
        value = values[name]
        if alias.convert is not None:
            try:
                value = alias.convert(value, values, cls)
            except ValueError as err:
                raise _alias_error(where, alias, str(err)) from None
        if alias.field in out and not _same(out[alias.field], value):
            raise HparamError(
                f"{where}: {name}={values[name]!r} ({alias.source} name for {alias.field}) and "
                f"{alias.field}={out[alias.field]!r} disagree; set one of them",
                name,
            )
        out[alias.field] = value
    return out, {alias.field: alias for alias in used.values()}


def _alias_error(where: str, alias: Alias, what: str) -> HparamError:
    detail = f"{alias.name} ({alias.source} name for {alias.field}) {what}"
    return HparamError(f"{where}: {detail}", alias.name, detail)


def settings_from(cls: type[Settings], values: Mapping[str, Any], where: str) -> Settings:
    """``cls`` made from ``values`` (aliases applied); an unknown key is refused naming the valid ones, and a bad
    value names the key as written (an alias by its own name)."""
    values, used = _canonical(cls, values, where)
    fields = cls.field_names()
    for f in dataclasses.fields(cls):
        if not f.init and f.name in values:  # fixed by the algorithm: its own value passes, no other
            value = values.pop(f.name)
            if value != f.default:
                raise HparamError(
                    f"{where}: {f.name} is fixed at {f.default!r} by {cls.algorithm or cls.__name__!r}, got {value!r}",
                    f.name,
                )
    unknown = sorted(set(values) - set(fields))
    if unknown:
        near = difflib.get_close_matches(unknown[0], [*fields, *aliases_of(cls)], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise HparamError(
            f"{where}: {unknown} are not settings of {cls.algorithm or cls.__name__!r}{hint} (valid: "
            f"{sorted(fields)}; other projects' names: {sorted(aliases_of(cls))})",
            unknown[0],
        )
    try:
        return cls(**values)
    except HparamError as err:
        if err.field in used:
            raise named_as_written(err, used, where) from None
        raise HparamError(f"{where}: {err.detail}", err.field, err.detail) from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=0, abs_tol=0) or a == b
    return a == b


# ---------------------------------------------------------------------- Megatron-Core

# Megatron-Core ``OptimizerConfig`` names we do not implement, and what to use instead.
MEGATRON_REFUSED: dict[str, str] = {
    "decoupled_lr": "a routing Rule whose options set lr for the embedding and the head",
    "decoupled_min_lr": "a routing Rule whose options set lr for the embedding and the head",
    "apply_wd_to_qk_layernorm": "a routing Rule whose options set weight_decay for the QK norms",
    "fp16": "Trainer(precision='16-mixed')",
    "bf16": "Trainer(precision='bf16-mixed' or 'bf16-true')",
    "fp8_recipe": "Lightning's TransformerEnginePrecision plugin",
    "reuse_grad_buf_for_mxfp8_param_ag": "Lightning's TransformerEnginePrecision plugin",
    "params_dtype": "the model's own dtype, or Trainer(precision=...)",
    "store_param_remainders": "main_params_dtype: float32 (whole fp32 master copies)",
    "loss_scale": "Trainer(precision='16-mixed'), which scales the loss dynamically",
    "initial_loss_scale": "Trainer(precision='16-mixed'), which scales the loss dynamically",
    "min_loss_scale": "Trainer(precision='16-mixed'), which scales the loss dynamically",
    "loss_scale_window": "Trainer(precision='16-mixed'), which scales the loss dynamically",
    "hysteresis": "Trainer(precision='16-mixed'), which scales the loss dynamically",
    "sgd_momentum": "muon or another matrix algorithm (there is no SGD here)",
    "use_distributed_optimizer": "strategy='muon_ddp' (each matrix orthogonalized on one rank) or 'muon_fsdp'",
    "use_layer_wise_distributed_optimizer": "strategy='muon_ddp' (each matrix orthogonalized on one rank)",
    "overlap_param_gather": "strategy='muon_fsdp' (FSDP2 prefetches its all-gathers)",
    "overlap_param_gather_with_optimizer_step": "strategy='muon_fsdp'",
    "optimizer_cpu_offload": "state.exp_avg_dtype / exp_avg_sq_dtype: bfloat16 to shrink the state",
    "optimizer_offload_fraction": "state.exp_avg_dtype / exp_avg_sq_dtype: bfloat16 to shrink the state",
    "use_torch_optimizer_for_cpu_offload": "state.exp_avg_dtype / exp_avg_sq_dtype: bfloat16",
    "overlap_cpu_optimizer_d2h_h2d": "state.exp_avg_dtype / exp_avg_sq_dtype: bfloat16",
    "pin_cpu_grads": "state.exp_avg_dtype / exp_avg_sq_dtype: bfloat16",
    "pin_cpu_params": "state.exp_avg_dtype / exp_avg_sq_dtype: bfloat16",
    "clip_grad": "Trainer(gradient_clip_val=...)",
    "log_num_zeros_in_grad": "a callback (the spectra callback logs update statistics)",
    "barrier_with_L1_time": "Lightning's profilers",
    "timers": "Lightning's profilers",
    "config_logger_dir": "LightningCLI's saved config.yaml",
    "optimizer_cuda_graph": "torch.compile of the training step",
}
# What Megatron-Core's ``OptimizerConfig`` defaults to, for the names that build a Muon here.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "lr": None,
    "min_lr": None,
    "weight_decay": 0.01,
    "decoupled_weight_decay": True,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "muon_momentum": 0.95,
    "muon_split_qkv": True,
    "muon_nesterov": False,
    "muon_scale_mode": "spectral",
    "muon_fp32_matmul_prec": "medium",
    "muon_coefficient_type": "quintic",
    "muon_num_ns_steps": 5,
    "muon_tp_mode": "blockwise",
    "muon_extra_scale_factor": 1.0,
    "muon_scalar_optimizer": "adam",
    "lion_beta1": 0.95,
    "lion_beta2": 0.98,
    "soap_shampoo_beta": 0.95,
    "soap_precondition_frequency": 1,
    "soap_use_kl_shampoo": True,
    "adaptive_muon_moment2_method": "adamuon",
    "adaptive_muon_beta2": 0.95,
    "adaptive_muon_eps": 1e-8,
    "use_precision_aware_optimizer": False,
    "main_grads_dtype": None,
    "main_params_dtype": None,
    "exp_avg_dtype": None,
    "exp_avg_sq_dtype": None,
}
MEGATRON_OPTIMIZERS = ("muon", "adaptive_muon", "soap")
_MEGATRON_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def megatron_sections(
    block: Mapping[str, Any], settings_class: Callable[[str], type[Settings]], state_class: type
) -> dict[str, Any]:
    """A Megatron-Core optimizer block as our config's sections: ``matrix``, ``scalar`` and ``state``
    (settings), ``split_qkv`` (routing) and ``min_lr_ratio`` (schedule), what Megatron would build.

    ``optimizer`` is ``"muon"``, ``"adaptive_muon"`` or ``"soap"`` on the hidden matrices (Megatron's
    emerging optimizers; Megatron sends embeddings, the head and every vector to its scalar
    optimizer, as our default rules do), with ``muon_scalar_optimizer`` ``"adam"`` (AdamW,
    ``adam_*``) or ``"lion"`` (``lion_*``). Every name Megatron's ``OptimizerConfig`` has and this
    block leaves out takes Megatron's default (``MEGATRON_DEFAULTS``); ``lr`` is required, as
    Megatron's training requires it. A Megatron name we do not implement is refused with what
    to use instead (``MEGATRON_REFUSED``), and so is any other name. ``settings_class`` gives an
    algorithm's settings class by name, ``state_class`` is ``StateSettings`` (this module sits
    below both: the algorithms read their aliases here).
    """

    where = "MuonConfig.megatron"
    refused = sorted(MEGATRON_REFUSED.keys() & block.keys())
    if refused:
        advice = "; ".join(f"{name}: use {MEGATRON_REFUSED[name]}" for name in refused)
        raise HparamError(f"{where}: Megatron's {refused} are not implemented here ({advice})", refused[0])
    unknown = sorted(set(block) - MEGATRON_DEFAULTS.keys() - {"optimizer"})
    if unknown:
        raise HparamError(
            f"{where}: {unknown} are not Megatron-Core OptimizerConfig names this config reads "
            f"(valid: {sorted([*MEGATRON_DEFAULTS, 'optimizer'])})",
            unknown[0],
        )
    m = {**MEGATRON_DEFAULTS, **block}
    if "optimizer" not in block or m["optimizer"] not in MEGATRON_OPTIMIZERS:
        got = f"got {block['optimizer']!r}" if "optimizer" in block else "it is missing (Megatron's default 'adam')"
        raise HparamError(
            f"{where}: optimizer must name the matrix algorithm, one of {MEGATRON_OPTIMIZERS}; {got}", "optimizer"
        )
    if m["lr"] is None:
        raise HparamError(f"{where}: lr is required (Megatron's training requires it too)", "lr")
    if m["decoupled_weight_decay"] is not True:
        raise HparamError(
            f"{where}: decoupled_weight_decay={m['decoupled_weight_decay']!r}: only decoupled decay (AdamW) is "
            "implemented; set it to true",
            "decoupled_weight_decay",
        )
    lr, wd = m["lr"], m["weight_decay"]
    shared = {"lr": lr, "weight_decay": wd, "weight_decay_method": "decoupled"}
    name = m["optimizer"]
    if name == "soap":  # the muon_* names are Muon's and AdaptiveMuon's: SOAP keeps its own precisions
        own = {
            "betas": (m["adam_beta1"], m["adam_beta2"]),
            "eps": m["adam_eps"],
            "shampoo_beta": m["soap_shampoo_beta"],
            "precondition_frequency": m["soap_precondition_frequency"],
            "use_kl_shampoo": m["soap_use_kl_shampoo"],
        }
    else:
        own = {
            "momentum": m["muon_momentum"],
            "nesterov": m["muon_nesterov"],
            "scale_mode": m["muon_scale_mode"],
            "num_ns_steps": m["muon_num_ns_steps"],
            "coefficient_type": m["muon_coefficient_type"],
            "extra_scale_factor": m["muon_extra_scale_factor"],
            "tp_mode": m["muon_tp_mode"],
            "fp32_matmul_prec": m["muon_fp32_matmul_prec"],
            "ns_method": "standard",
        }
        if name == "adaptive_muon":
            own.update(
                moment2_method=m["adaptive_muon_moment2_method"],
                beta2=m["adaptive_muon_beta2"],
                eps=m["adaptive_muon_eps"],
            )
    megatron_names = _megatron_names(name)
    matrix = _megatron_settings(settings_class(name), {**shared, **own}, megatron_names)
    scalar_name = m["muon_scalar_optimizer"]
    if scalar_name == "adam":
        scalar_values = {"betas": (m["adam_beta1"], m["adam_beta2"]), "eps": m["adam_eps"]}
        scalar_values = {"lr": lr, "weight_decay": wd, **scalar_values}
        scalar = _megatron_settings(settings_class("adamw"), scalar_values, megatron_names)
    elif scalar_name == "lion":
        scalar_values = {"lr": lr, "weight_decay": wd, "betas": (m["lion_beta1"], m["lion_beta2"])}
        scalar = _megatron_settings(settings_class("lion"), scalar_values, megatron_names)
    else:
        raise HparamError(
            f"{where}: muon_scalar_optimizer must be 'adam' or 'lion', got {scalar_name!r}", "muon_scalar_optimizer"
        )
    state = _megatron_state(m, state_class)
    min_lr = m["min_lr"]
    out = {"matrix": matrix, "scalar": scalar, "state": state, "split_qkv": m["muon_split_qkv"]}
    if min_lr is not None:
        if not (isinstance(min_lr, (int, float)) and 0 <= min_lr <= lr and lr > 0):
            raise HparamError(f"{where}: min_lr must be in [0, lr={lr!r}], got {min_lr!r}", "min_lr")
        out["min_lr_ratio"] = min_lr / lr
    return out


def _megatron_names(optimizer: str) -> dict[str, str]:
    """Our field (or alias) -> the Megatron name that set it, to name in errors."""
    names = {
        "lr": "lr",
        "weight_decay": "weight_decay",
        "fp32_matmul_prec": "muon_fp32_matmul_prec",
        "momentum": "muon_momentum",
        "nesterov": "muon_nesterov",
        "scale_mode": "muon_scale_mode",
        "num_ns_steps": "muon_num_ns_steps",
        "coefficient_type": "muon_coefficient_type",
        "extra_scale_factor": "muon_extra_scale_factor",
        "tp_mode": "muon_tp_mode",
        "moment2_method": "adaptive_muon_moment2_method",
        "beta2": "adaptive_muon_beta2",
        "eps": "adaptive_muon_eps" if optimizer == "adaptive_muon" else "adam_eps",
        "shampoo_beta": "soap_shampoo_beta",
        "precondition_frequency": "soap_precondition_frequency",
        "use_kl_shampoo": "soap_use_kl_shampoo",
        "betas": "adam_beta1/adam_beta2",
    }
    return names


def _megatron_settings(cls: type[Settings], values: dict[str, Any], names: Mapping[str, str]) -> Settings:
    try:
        return settings_from(cls, values, "MuonConfig.megatron")
    except HparamError as err:
        megatron = names.get(err.field, err.field)
        if cls.algorithm == "lion" and err.field == "betas":
            megatron = "lion_beta1/lion_beta2"
        what = re.sub(r"^\S+( \([^)]*\))? ", "", err.detail)  # the field (and whose name it is) dropped
        raise HparamError(f"MuonConfig.megatron: {megatron} {what}", megatron, f"{megatron} {what}") from None


def _megatron_state(m: Mapping[str, Any], state_cls: type) -> Any:
    where = "MuonConfig.megatron"
    dtypes = {n: m[n] for n in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype") if m[n] is not None}
    if m["main_grads_dtype"] not in (None, "float32", "fp32"):
        raise HparamError(
            f"{where}: main_grads_dtype={m['main_grads_dtype']!r}: gradients are used in the parameter's dtype "
            "here; leave it at float32",
            "main_grads_dtype",
        )
    if dtypes and m["use_precision_aware_optimizer"] is not True:
        raise HparamError(
            f"{where}: {sorted(dtypes)} apply only with use_precision_aware_optimizer: true (as in Megatron)",
            sorted(dtypes)[0],
        )
    values = {}
    for name, value in dtypes.items():
        key = str(value).removeprefix("torch.")
        if key not in _MEGATRON_DTYPES:
            raise HparamError(f"{where}: {name} must be float32 or bfloat16, got {value!r}", name)
        values[name] = _MEGATRON_DTYPES[key]
    if values.get("main_params_dtype") == "bfloat16":
        raise HparamError(
            f"{where}: main_params_dtype must be float32 (an fp32 master copy), got bfloat16", "main_params_dtype"
        )
    try:
        return state_cls(**values)
    except HparamError as err:
        raise HparamError(f"{where}: {err}", err.field) from None
