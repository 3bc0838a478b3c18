"""A Megatron-Core optimizer block (its ``OptimizerConfig`` names) translated into a ``MuonConfig``'s sections.

The seed's Megatron-Core ``OptimizerConfig`` names (``optimizer``, ``lr``, ``min_lr``, ``adam_*``,
``muon_*``, ``lion_*``, ``soap_*``, ``adaptive_muon_*`` and the precision-aware dtypes) are read
whole, here, at the edge of the config (``MuonConfig.from_megatron``, its ``megatron`` section):
one of them may set several of our settings (``lr`` is every group's), its defaults are
Megatron's (``MEGATRON_DEFAULTS``), and a name we do not implement is refused with what to use
instead (``MEGATRON_REFUSED``). What comes out are our settings objects; nothing below the config
reads a Megatron name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.settings import Settings
from lightning_muon.aliases import settings_from

__all__ = ["MEGATRON_DEFAULTS", "MEGATRON_OPTIMIZERS", "MEGATRON_REFUSED", "megatron_sections"]

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
