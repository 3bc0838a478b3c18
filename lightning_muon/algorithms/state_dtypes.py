"""Narrower optimizer state under Megatron-Core's names: ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_params_dtype``.

Megatron-Core's precision-aware optimizer stores AdamW's moments in bf16 and keeps an fp32
master copy of bf16 parameters. The same three optimizer-wide settings here
(``StateSettings``: ``Muon``'s keywords, ``MuonConfig``'s ``state`` section):

- ``exp_avg_dtype``: ``"float32"`` (default) or ``"bfloat16"``: the dtype first moments are
  stored in: Muon's ``momentum_buffer`` (every Muon variant's), AdamW's and Lion's
  ``exp_avg``.
- ``exp_avg_sq_dtype``: the same for second moments: AdamW's ``exp_avg_sq``, NorMuon's and
  AdaMuon's ``second_moment``.
- ``main_params_dtype``: None (default: the parameters are the master copy) or
  ``"float32"``: a bf16 or fp16 parameter gets an fp32 copy in ``state[p]["main_param"]``;
  the step updates the copy and writes it, rounded, into the parameter.

State is stored in the setting's dtype where that is narrower than its parameter's (or its
master copy's) dtype and never widened: ``"float32"`` keeps every buffer in its
parameter's dtype, as torch.optim does (fp64 state for fp64 parameters, bf16 state for bf16
parameters without a master copy). A narrow buffer is read into the parameter's dtype,
updated and used there, and rounded once on its way back (``functional``), so only the
stored value loses digits, once per step.

The built-in algorithms say which settings they honour (``Algorithm.state_dtype_settings``); a
group of an algorithm that does not honour a setting that is not at its default is refused
(``Muon.add_param_group``): nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_muon.algorithms.checks import HparamError

__all__ = [
    "MAIN_PARAM",
    "MAIN_PARAMS_DTYPES",
    "STATE_DTYPES",
    "STATE_SETTINGS",
    "MainParamsDtype",
    "StateDtype",
    "check_main_params_dtype",
    "check_state_dtype",
    "has_main_param",
    "restore_state_dtypes",
    "state_dtype",
    "storage_dtype",
]

STATE_DTYPES = ("float32", "bfloat16")
MAIN_PARAMS_DTYPES = (None, "float32")
StateDtype = Literal["float32", "bfloat16"]
MainParamsDtype = Literal["float32"] | None
# Every setting with its default; an algorithm lists those it honours in ``state_dtype_settings``.
STATE_SETTINGS = {"exp_avg_dtype": "float32", "exp_avg_sq_dtype": "float32", "main_params_dtype": None}
MAIN_PARAM = "main_param"
"""The state key of a parameter's fp32 master copy."""
# State keys of the built-in algorithms, by the setting that stores them.
_KEYS = {"exp_avg_dtype": ("momentum_buffer", "exp_avg"), "exp_avg_sq_dtype": ("exp_avg_sq", "second_moment")}
_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_TORCH = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _name(value: Any) -> str | None:
    if isinstance(value, torch.dtype):
        return _TORCH.get(value)
    return _NAMES.get(value) if isinstance(value, str) else None


def check_state_dtype(value: Any, name: str) -> str:
    """``value`` as a stored name (``"float32"``, ``"bfloat16"``); also takes ``"bf16"``, ``"fp32"`` and torch dtypes.

    Raises ``HparamError`` naming ``name`` (the setting) and the choices.
    """
    normalized = _name(value)
    if normalized is None:
        raise HparamError(f"{name} must be one of {STATE_DTYPES}, got {value!r}", name)
    return normalized


def check_main_params_dtype(value: Any) -> str | None:
    """``value`` as stored: None or ``"float32"`` (also ``"fp32"``, ``torch.float32``)."""
    normalized = None if value is None else _name(value)
    if value is not None and normalized != "float32":
        raise HparamError(f"main_params_dtype must be one of {MAIN_PARAMS_DTYPES}, got {value!r}", "main_params_dtype")
    return normalized


def storage_dtype(setting: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a buffer of a ``dtype`` parameter (or master copy) is stored in under ``setting``."""
    if setting == "bfloat16" and dtype.is_floating_point and dtype.itemsize > 2:
        return torch.bfloat16
    return dtype


def state_dtype(holder: Any, setting: str, p: Tensor) -> torch.dtype:
    """The dtype of a new ``setting`` buffer (``"exp_avg_dtype"``, ...) for ``p``, the tensor the step updates;
    ``holder`` has the ``state_settings`` (a ``Muon``, its ``StepContext``)."""
    return storage_dtype(getattr(holder.state_settings, setting, "float32"), p.dtype)


def has_main_param(state_settings: Any, p: Tensor) -> bool:
    """Whether ``p`` steps on an fp32 master copy: ``main_params_dtype="float32"`` and ``p`` is bf16 or fp16."""
    return state_settings.main_params_dtype is not None and p.is_floating_point() and p.dtype.itemsize < 4


@torch.no_grad()
def restore_state_dtypes(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """After ``Optimizer.load_state_dict``: every buffer in its configured dtype, master copies in fp32.

    torch casts every floating state tensor to its parameter's dtype on load: a bf16 moment of
    an fp32 parameter comes back fp32 (exactly; cast back here) and an fp32 master copy of a
    bf16 parameter would come back rounded (taken again from ``state_dict``). A checkpoint
    saved with another setting is cast to this one; a master copy this optimizer does not
    keep is dropped (and one it keeps but the checkpoint lacks is made at the next step).
    """
    settings = optimizer.state_settings
    saved_state = state_dict.get("state", {})
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for saved_id, p in zip(saved_ids, params):
        entry = optimizer.state.get(p)
        if not entry:
            continue
        saved = saved_state.get(saved_id, {})
        main = has_main_param(settings, p)
        if MAIN_PARAM in entry:
            if main:
                entry[MAIN_PARAM] = _wide(entry[MAIN_PARAM], saved.get(MAIN_PARAM), torch.float32)
            else:
                del entry[MAIN_PARAM]
        updated = torch.float32 if main else p.dtype  # the dtype the step updates p in
        for setting, keys in _KEYS.items():
            dtype = storage_dtype(getattr(settings, setting), updated)
            for key in _present(entry, keys):
                entry[key] = _wide(entry[key], saved.get(key), dtype)


def _present(entry: dict[str, Any], keys: Iterable[str]) -> list[str]:
    return [k for k in keys if isinstance(entry.get(k), Tensor) and entry[k].is_floating_point()]


def _wide(loaded: Tensor, saved: Any, dtype: torch.dtype) -> Tensor:
    """``loaded`` (torch's cast to the parameter's dtype) in ``dtype``, from ``saved`` where ``loaded`` lost digits."""
    if loaded.dtype == dtype:
        return loaded
    if dtype.itemsize > loaded.itemsize and isinstance(saved, Tensor) and saved.dtype.itemsize > loaded.itemsize:
        return saved.to(device=loaded.device, dtype=dtype, copy=True)
    return loaded.to(dtype)
