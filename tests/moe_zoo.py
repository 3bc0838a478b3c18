"""The mixture-of-experts zoo of the installed transformers, and the truth of each expert stack.

Used by ``tests/test_moe_zoo.py``, and run as a script to print the table docs/moe.md shows::

    python tests/moe_zoo.py            # the table, as markdown, for the installed transformers

- ``families()``: every model folder whose modeling code defines a class named for experts that
  holds ``nn.Parameter``s (read from the sources, not a kept list), and in each the model types
  (or sub-configs) whose models hold those classes: a thinker/talker pair is two families.
- ``build(family)``: the model built tiny from its own config (hidden 32, intermediate 24, 4
  experts, 2 layers where the config lets the layers be cut), float32, on the CPU.
- ``truth(model, family)``: for the first module of each experts class, what its own forward
  says, by a method of this file's own (not the routing's): every stack's matrices, found by
  feeding one token at a time (random hidden state, the other tokens zero) through the module
  with the arguments it got in a forward of the whole model, and reading which slice of the
  stack the token's gradient lives in, and its rank-1 factors (the one along the hidden state
  is the input axis, the one along the loss weights the output axis); gate and up pairs by
  Hessian-vector products (the output rows whose gradients a change of row 0 moves); routers
  as the parameters ``torch.topk``'s inputs depend on in the block around the experts.
- ``cut(...)``: a stack's matrices as a canonical set (per matrix, its output lines as tuples
  of element indices), for the truth and for a routed layout alike, so that two cuts are equal
  exactly when they give Muon the same matrices facing the same way.
"""

from __future__ import annotations

import ast
import importlib
import math
import pathlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

H, INTER, EXPERTS = 32, 24, 4
SIZES = {  # the shrunk value of every size field a config has (the others keep their defaults)
    "hidden_size": H, "d_model": H, "n_embd": H,
    "intermediate_size": INTER, "moe_intermediate_size": INTER, "expert_ffn_hidden_size": INTER,
    "shared_expert_intermediate_size": INTER, "moe_shared_expert_intermediate_size": INTER, "ffn_hidden_size": INTER,
    "num_attention_heads": 4, "n_heads": 4, "num_key_value_heads": 2, "kv_n_heads": 2,
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_routed_experts": EXPERTS, "n_shared_experts": 1, "num_dense_layers": 0, "zero_expert_num": 2,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_top_k": 2, "top_k_experts": 2, "moe_k": 2,
    "moe_topk": 2, "n_group": 1, "num_expert_group": 1, "topk_group": 1, "num_shared_experts": 1,
    "first_k_dense_replace": 0, "decoder_sparse_step": 1, "max_position_embeddings": 128,
}  # fmt: skip
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "moe_topk", "top_k_experts", "moe_k")
_NONE_MEANS_OFF = ("max_position_embeddings", "first_k_dense_replace")
_LAYERS = ("num_hidden_layers", "n_layers", "num_layers")
# What the generic shrinking cannot know: a value its config lacks or a relation it checks (by config
# class, merged over the shrunk values).
FIXES: dict[str, dict[str, Any]] = {
    # Its attention reads a field the config does not define, and clamps by clip_qkv (None by default).
    "DbrxConfig": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "HunYuanMoEV1Config": {"head_dim": 8},  # None by default, and the attention raises on it
    "GraniteMoeHybridConfig": {"mamba_n_heads": 4, "mamba_d_head": 16},  # n_heads must divide 2 * hidden
    "Lfm2MoeConfig": {"layer_types": ["conv", "full_attention"], "num_hidden_layers": 2},  # None by default
    "DeepseekOcr2TextConfig": {"mlp_layer_types": ["dense", "sparse"], "num_hidden_layers": 2},  # None by default
    "Ernie4_5_VLMoeTextConfig": {"head_dim": 128},  # its 3-D rope sections sum to 64
    "Ernie4_5_VLMoeConfig": {"text_config": {"head_dim": 128}},
    "Qwen3OmniMoeTalkerTextConfig": {"shared_expert_intermediate_size": INTER},  # read, not defined
}
if tuple(int(v) for v in __import__("transformers").__version__.split(".")[:2]) < (5, 24):
    # Before 5.24 DBRX's router reads ffn_hidden_size inputs (square experts make it build), and its
    # experts' forward indexes one token per expert wrongly with top-1 routing.
    FIXES["DbrxConfig"] = {**FIXES["DbrxConfig"], "ffn_config": {"ffn_hidden_size": H, "moe_top_k": 2}}
    FIXES["GraniteMoeHybridConfig"] = {**FIXES["GraniteMoeHybridConfig"], "layer_types": ["mamba", "attention"]}
_SKIP_TYPES = ("vision", "audio", "encoder", "sam_", "code_predictor")


@dataclass
class Family:
    """One family: a model type (or a sub-config of one) whose model holds experts classes."""

    folder: str
    name: str
    """The model type, or ``type/sub.config`` for a sub-config."""
    experts_classes: tuple[str, ...]
    config: Any = None
    model_class: type | None = None
    error: str | None = None
    """Why it could not be built tiny."""


def expert_classes_by_folder() -> dict[str, set[str]]:
    """Model folder -> its classes named for experts that hold ``nn.Parameter``s, read from the sources."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    out: dict[str, set[str]] = {}
    for f in sorted(root.glob("*/modeling_*.py")):
        text = f.read_text()
        for node in ast.walk(ast.parse(text)):
            named = isinstance(node, ast.ClassDef) and "expert" in node.name.lower()
            if named and "nn.Parameter(" in (ast.get_source_segment(text, node) or ""):
                out.setdefault(f.parent.name, set()).add(node.name)
    return out


def families() -> list[Family]:
    """Every family of the installed transformers with expert parameters, each built tiny or with its error."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    warnings.filterwarnings("ignore", module="transformers")
    types: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        types.setdefault(model_type_to_module_name(model_type), []).append(model_type)
    out = []
    for folder, classes in expert_classes_by_folder().items():
        found: list[Family] = []
        covered: set[str] = set()
        errors = []
        candidates = sorted(types.get(folder, []), key=lambda t: (not t.endswith("_text"), t != folder, t))
        for model_type in [t for t in candidates if not any(s in t for s in _SKIP_TYPES)]:
            try:
                base = AutoConfig.for_model(model_type)
            except Exception as err:
                errors.append(f"{model_type}: {type(err).__name__}: {err}")
                continue
            for name, cfg in [(model_type, base), *_sub_configs(model_type, base)]:
                try:
                    config, cls, model = _build_tiny(folder, name, cfg)
                except Exception as err:
                    errors.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                    continue
                held = {type(m).__name__ for m in model.modules()} & classes
                if held - covered:
                    found.append(Family(folder, name, tuple(sorted(held - covered)), config, cls))
                    covered |= held
                if covered >= classes:
                    break
            if covered >= classes:
                break
        if not found or covered < classes:
            missing = sorted(classes - covered)
            reason = "; ".join(errors[:2]) or "no model type builds a model holding it"
            found.append(Family(folder, folder, tuple(missing), error=reason))
        out += found
    return out


def _sub_configs(model_type: str, cfg: Any) -> list[tuple[str, Any]]:
    from transformers import PretrainedConfig

    out = []
    for key, value in vars(cfg).items():
        if isinstance(value, PretrainedConfig):
            out.append((f"{model_type}/{key}", value))
            out += [(f"{model_type}/{key}.{k.split('/', 1)[1]}", v) for k, v in _sub_configs(model_type, value)]
    return out


def _overrides(d: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """The keys of a config's dict to change (sub-configs as dicts of their own changes)."""
    total = next((d[k] for k in _LAYERS if isinstance(d.get(k), int)), None)
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            sub = _overrides(v, layers)
            if sub:
                out[k] = sub
        elif (
            k in SIZES
            and v != 0
            and not isinstance(v, bool)
            and (isinstance(v, int) or (v is None and k not in _NONE_MEANS_OFF))
        ):
            out[k] = min(SIZES[k], v) if k in _TOP_K and v is not None else SIZES[k]
        elif k in SIZES and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            out[k] = [] if k == "mlp_only_layers" else [SIZES[k]] * len(v)
        elif k == "mlp_only_layers" and isinstance(v, list):
            out[k] = []
        elif k.startswith(("enable_moe", "use_moe")) and v is False:
            out[k] = True
        elif k.endswith("num_heads") and isinstance(v, int) and v > 4:
            out[k] = 4
        elif "vocab_size" in k and isinstance(v, int) and v > 96:
            out[k] = 96
        elif k.endswith("token_id") and isinstance(v, int):
            out[k] = min(v, 3)
        elif layers and total and total > layers and k in _LAYERS:
            out[k] = layers
    heads = out.get("num_attention_heads", d.get("num_attention_heads"))
    if d.get("num_key_value_heads") is not None and d.get("num_key_value_heads") == d.get("num_attention_heads"):
        out["num_key_value_heads"] = heads
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _model_class(folder: str, config_class: type) -> type:
    from transformers import PreTrainedModel

    module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    found = [
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and issubclass(v, PreTrainedModel)
        and getattr(v, "config_class", None) is config_class
        and "PreTrained" not in v.__name__
    ]
    if not found:
        raise ValueError(f"no model class in modeling_{folder} takes {config_class.__name__}")
    return min(found, key=lambda v: (not v.__name__.endswith("Model"), len(v.__name__)))


def _build_tiny(folder: str, name: str, cfg: Any) -> tuple[Any, type, nn.Module]:
    first = None
    fix = FIXES.get(type(cfg).__name__, {})
    for layers in (2, 4, None):  # cut the layers where the config lets the MoE layers stay
        try:
            config = type(cfg)(**_merge(_overrides(cfg.to_dict(), layers), fix))
            cls = _model_class(folder, type(config))
            with torch.device("meta"):
                size = sum(p.numel() for p in cls(config).parameters())
            if size > 3e7:
                raise ValueError(f"{size:,} parameters after shrinking")
            torch.manual_seed(0)
            model = cls(config)
            if not any("expert" in type(m).__name__.lower() for m in model.modules()):
                raise ValueError("no experts module with these layers")
            return config, cls, model
        except Exception as err:
            first = first or err
    raise first


def build(family: Family) -> nn.Module:
    """The family's tiny model, float32, every parameter drawn from N(0, 0.1^2)."""
    torch.manual_seed(0)
    model = family.model_class(family.config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    for m in model.modules():  # the experts' own forward as the model file writes it (float64 runs too)
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    return model.eval()


# ---------------------------------------------------------------------- the truth


class TruthError(Exception):
    """The truth of a family could not be read (its forward did not run)."""


@dataclass
class StackTruth:
    """What a stack's module's own forward says of it."""

    name: str
    shape: tuple[int, ...]
    matrices: str = ""
    """``"dim0"`` (one matrix per slice of dim 0), ``"rows:F"`` (2-D, blocks of F rows), or ``""`` unknown."""
    transposed: bool | None = None
    pair: int | None = None
    """Gate and up: output rows ``j`` and ``j + pair`` in blocks of ``pair`` (``None``: no pairing)."""
    why: str = ""

    def pieces(self) -> list[Tensor] | None:
        """Every matrix of the stack as its element indices, ``(out, in)`` as ``nn.Linear`` stores it."""
        if self.transposed is None or not self.matrices:
            return None
        idx = torch.arange(math.prod(self.shape)).view(self.shape)
        if self.matrices == "dim0":
            mats = list(idx.reshape(-1, *self.shape[-2:]))
        else:
            rows = int(self.matrices.split(":")[1])
            mats = list(idx.view(-1, rows, self.shape[-1]))
        out = []
        for m in mats:
            m = m.T if self.transposed else m  # rows = outputs
            if self.pair:
                sel = (torch.arange(m.shape[0]) // self.pair) % 2
                out += [m[sel == 0], m[sel == 1]]
            else:
                out.append(m)
        return out

    def cut(self) -> frozenset | None:
        pieces = self.pieces()
        if pieces is None:
            return None
        return frozenset(frozenset(tuple(r.tolist()) for r in m) for m in pieces)


@dataclass
class ModuleTruth:
    """The truth of one experts module: its stacks, and the routers of the block around it."""

    module: str
    cls: str
    stacks: list[StackTruth] = field(default_factory=list)
    routers: set[str] = field(default_factory=set)


def routed_cut(layout: Any, shape: tuple[int, ...]) -> frozenset:
    """The matrices a routed ``MatrixLayout`` gives Muon, in ``StackTruth.cut``'s form."""
    idx = torch.arange(math.prod(shape)).view(shape)
    out = []
    for piece in layout.views(idx):
        mats = list(piece.reshape(-1, *piece.shape[-2:])) if piece.ndim == 3 else [piece]
        for m in mats:
            m = m.T if layout.transposed else m
            out.append(frozenset(tuple(r.tolist()) for r in m))
    return frozenset(out)


def _inputs(model: nn.Module) -> dict[str, Any]:
    vocab = getattr(model.config, "vocab_size", None) or 96
    ids = torch.randint(4, min(vocab, 96), (1, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "use_cache": False}


def truth(model: nn.Module, family: Family) -> list[ModuleTruth]:
    """The truth of the experts modules of the first MoE block (module docstring), in float64 (float32 where
    the model's own code mixes in float32 tensors)."""
    try:
        return _truth(model.double(), family)
    except TruthError:
        return _truth(model.float(), family)


def _truth(model: nn.Module, family: Family) -> list[ModuleTruth]:
    names = {id(m): n for n, m in model.named_modules()}
    parents = {id(c): m for m in model.modules() for c in m.children()}
    first = next(m for m in model.modules() if type(m).__name__ in family.experts_classes)
    block = parents.get(id(first), first)
    while not any(True for _ in block.parameters() if True) or all(
        type(c).__name__ in family.experts_classes for c in block.children()
    ):  # up to the module that holds something besides the experts (their router)
        if id(block) not in parents:
            break
        block = parents[id(block)]
    modules = [m for m in block.modules() if type(m).__name__ in family.experts_classes]
    watched = {id(block)} | {id(x) for m in modules for x in _up_to(m, block, parents)}
    calls: dict[int, tuple[tuple, dict]] = {}
    handles = [
        x.register_forward_pre_hook(lambda mod, a, k: calls.setdefault(id(mod), (a, k)), with_kwargs=True)
        for x in model.modules()
        if id(x) in watched
    ]
    try:
        with torch.no_grad():
            try:
                model(**_inputs(model))
            except Exception as err:
                widths = dict.fromkeys(d for q in first.parameters() for d in q.shape[-2:])
                first_dtype = next(first.parameters()).dtype
                for width in widths:
                    calls.clear()
                    x = torch.randn(1, 8, width, generator=torch.Generator().manual_seed(3), dtype=first_dtype)
                    try:
                        block(x)
                        break
                    except Exception as err2:
                        last = err2
                else:
                    raise TruthError(
                        f"the tiny model's forward raised {type(err).__name__}: {str(err).splitlines()[0][:120]}; "
                        f"its MoE block's {type(last).__name__}: {str(last).splitlines()[0][:120]}"
                    ) from None
    finally:
        for h in handles:
            h.remove()
    out = []
    for m in modules:
        mt = ModuleTruth(names[id(m)], type(m).__name__)
        callers = [x for x in _up_to(m, block, parents) if id(x) in calls]  # DBRX hands its weights down
        params = {
            f"{names[id(o)]}.{leaf}": p
            for o in m.modules()
            for leaf, p in o.named_parameters(recurse=False)
            if p.ndim >= 2 and not (leaf == "bias" or leaf.endswith("_bias"))
        }
        for name, p in params.items():
            mt.stacks.append(_stack_truth(name, p, callers, calls, m, (block, calls.get(id(block)))))
        if id(block) in calls:
            mt.routers = _router_truth(block, calls[id(block)], names)
        out.append(mt)
    return out


def _up_to(m: nn.Module, block: nn.Module, parents: dict[int, nn.Module]) -> list[nn.Module]:
    """``m`` and the modules around it, below ``block``."""
    chain = [m]
    while id(chain[-1]) in parents and parents[id(chain[-1])] is not block:
        chain.append(parents[id(chain[-1])])
    return chain


def _zero_biases(m: nn.Module) -> dict[str, Tensor]:
    """Zero the experts' biases (restored after): a token that is zero then adds nothing anywhere."""
    saved = {}
    for n, p in m.named_parameters():
        leaf = n.rsplit(".", 1)[-1]
        if leaf == "bias" or leaf.endswith("_bias"):
            saved[n] = p.detach().clone()
            with torch.no_grad():
                p.zero_()
    return saved


def _restore(m: nn.Module, saved: dict[str, Tensor]) -> None:
    params = dict(m.named_parameters())
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t)


def _run(caller: nn.Module, call: tuple[tuple, dict], hidden: Tensor) -> Tensor:
    args, kwargs = call
    args = list(args)
    at = next((i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()), None)
    if at is not None:
        args[at] = hidden.view(args[at].shape)
    else:
        key = next(k for k, a in kwargs.items() if torch.is_tensor(a) and a.is_floating_point())
        kwargs = {**kwargs, key: hidden.view(kwargs[key].shape)}
    out = caller(*args, **kwargs)
    while not torch.is_tensor(out):
        out = out[0]
    return out


def _hidden_of(call: tuple[tuple, dict]) -> Tensor:
    args, kwargs = call
    for a in (*args, *kwargs.values()):
        if torch.is_tensor(a) and a.is_floating_point():
            return a
    raise ValueError("no floating argument")


def _stack_truth(
    name: str, p: Tensor, callers: list[nn.Module], calls: dict, module: nn.Module, block_call: tuple
) -> StackTruth:
    t = StackTruth(name, tuple(p.shape))
    gen = torch.Generator().manual_seed(7)
    for caller in callers:
        call = calls[id(caller)]
        rows = _hidden_of(call).reshape(-1, _hidden_of(call).shape[-1])
        saved = _zero_biases(module)
        try:
            with torch.enable_grad():
                reading = _read_tokens(caller, call, rows, p, gen)
                if reading is not None and reading[1] is not None and reading[2] == "input":
                    # Through the whole block: JetMoE chunks gate and up outside its experts module.
                    block, bcall = block_call if block_call[1] is not None else (caller, call)
                    brows = _hidden_of(bcall).reshape(-1, _hidden_of(bcall).shape[-1])
                    t.pair = _pair_truth(block, bcall, brows, p, reading[1], reading[0], gen)
        except RuntimeError:  # a call that hands it views of the weights (DBRX): the next caller up
            reading = None
        finally:
            _restore(module, saved)
        if reading is None:
            continue
        t.matrices, t.transposed, side, _ = reading
        if t.transposed is None:
            t.why = side
        return t
    t.why = "no call of its module uses it"
    return t


def _matrices_of(g: Tensor, matrices: str) -> Tensor:
    """A gradient as its matrices ``(B, rows, cols)``."""
    if matrices == "dim0":
        return g.reshape(-1, *g.shape[-2:])
    return g.view(-1, int(matrices.split(":")[1]), g.shape[-1])


def _read_tokens(caller, call, rows, p, gen):
    """Tokens one at a time (the others zero); the first whose gradient reaches ``p`` decides its matrices
    and sides: ``(matrices, transposed, side or why, row)``, None if no token reaches it."""
    n, width = rows.shape
    for r in range(min(n, 16)):
        x = torch.randn(width, generator=gen, dtype=rows.dtype)
        fed = torch.zeros_like(rows)
        fed[r] = x
        out = _run(caller, call, fed)
        w = torch.randn(out.shape, generator=gen, dtype=out.dtype)
        (g,) = torch.autograd.grad((out * w).sum(), [p], allow_unused=True)
        if g is None or not g.ne(0).any():
            continue
        if p.ndim >= 3:
            slices = g.reshape(-1, *p.shape[-2:])
            hit = slices.flatten(1).ne(0).any(dim=1).nonzero().flatten()
            m, matrices = slices[hit[0]], "dim0"
        else:
            hit_rows = g.ne(0).any(dim=1).nonzero().flatten()
            first, last = int(hit_rows.min()), int(hit_rows.max()) + 1
            size = last - first
            if size == p.shape[0] or p.shape[0] % size:
                return "", None, f"token {r}'s gradient spans rows {first}..{last - 1} of {p.shape[0]}", r
            m, matrices = g[first:last], f"rows:{size}"
        u, s, vh = torch.linalg.svd(m)
        if s.numel() > 1 and s[1] > 1e-5 * s[0]:  # float32 inside some experts: rank one to its rounding
            return matrices, None, "one token's gradient is not rank one", r
        left, right = u[:, 0], vh[0]

        def along(v: Tensor, ref: Tensor) -> bool:
            return v.shape == ref.shape and abs(float(v @ ref)) > (1 - 1e-5) * float(ref.norm())

        if along(right, x / x.norm()):
            return matrices, False, "input", r
        if along(left, x / x.norm()):
            return matrices, True, "input", r
        # Not on the input side: on the output side, whose axis is as long as the module's output (the
        # other holds the intermediate); where both are, the one along the loss weights of the token.
        width_out = out.shape[-1]
        rows_out, cols_out = m.shape[0] == width_out, m.shape[1] == width_out
        if rows_out != cols_out:
            return matrices, cols_out, "output", r
        wrows = w.reshape(-1, width_out)
        if any(along(left, wr / wr.norm()) for wr in wrows):
            return matrices, False, "output", r
        if any(along(right, wr / wr.norm()) for wr in wrows):
            return matrices, True, "output", r
        return matrices, None, "neither factor is the token's hidden state or the loss weights", r
    return None


def _pair_truth(caller, call, rows, p, transposed: bool, matrices: str, gen) -> int | None:
    """Gate and up pair: the output row whose gradient a zeroed row silences (a gated unit: a zero gate
    stops its up row's gradient, a zero up its gate's), for rows 0 and 1 of every expert; their (p, p)."""
    fed = rows.clone()
    fed.copy_(torch.randn(rows.shape, generator=gen, dtype=rows.dtype))

    def lines(zero: int | None) -> list[bool]:
        saved = p.detach().clone()
        try:
            if zero is not None:
                with torch.no_grad():
                    mats = _matrices_of(p.data, matrices)
                    (mats[:, :, zero] if transposed else mats[:, zero]).zero_()
            out = _run(caller, call, fed)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(11), dtype=out.dtype)
            (g,) = torch.autograd.grad((out * w).sum(), [p])
        finally:
            with torch.no_grad():
                p.copy_(saved)
        mats = _matrices_of(g, matrices).ne(0)
        mats = mats.transpose(1, 2) if transposed else mats
        return mats.any(dim=2).any(dim=0).tolist()

    base = lines(None)
    outputs = len(base)
    partners = []
    for row in (0, 1):
        silenced = [i for i, (b, z) in enumerate(zip(base, lines(row))) if b and not z and i != row]
        partners.append(silenced)
    found = [ps[0] - row for row, ps in enumerate(partners) if len(ps) == 1]
    if not found:
        return None
    pair = abs(found[0])
    return pair if outputs % (2 * pair) == 0 else None


class _TopK(torch.overrides.TorchFunctionMode):
    """Records the input of every ``torch.topk`` and the innermost module running when it was called."""

    def __init__(self, stack: list[nn.Module]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[Tensor, nn.Module | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "topk":
            self.calls.append((args[0], self.stack[-1] if self.stack else None))
        return func(*args, **(kwargs or {}))


def _router_truth(block: nn.Module, call: tuple[tuple, dict], names: dict[int, str]) -> set[str]:
    """The routers: the parameters (2+ dims) of the module that calls ``torch.topk`` that its input depends on."""
    stack: list[nn.Module] = []
    handles = []
    for m in block.modules():
        handles.append(m.register_forward_pre_hook(lambda mod, a: stack.append(mod)))
        handles.append(m.register_forward_hook(lambda mod, a, o: stack.pop() and None))  # None: output unchanged
    args, kwargs = call
    mode = _TopK(stack)
    try:
        with torch.enable_grad(), mode:
            block(*args, **kwargs)
    except Exception:
        return set()
    finally:
        for h in handles:
            h.remove()
    out = set()
    for scores, owner in mode.calls:
        if owner is None or not scores.is_floating_point() or not scores.requires_grad:
            continue
        params = [(n, q) for n, q in owner.named_parameters() if q.ndim >= 2 and q.requires_grad]
        if not params:
            continue
        grads = torch.autograd.grad(scores.square().sum(), [q for _, q in params], allow_unused=True, retain_graph=True)
        prefix = names[id(owner)]
        out |= {f"{prefix}.{n}" for (n, _), g in zip(params, grads) if g is not None and g.ne(0).any()}
    return out


# ---------------------------------------------------------------------- the table


def main() -> None:
    """Print the zoo as a markdown table: each family's stacks as routed, what decided them, its routers."""
    import transformers

    from lightning_muon import route_parameters

    rows, counts = [], {"metadata": 0, "probe": 0, "unread": 0, "not built": 0}
    for family in families():
        if family.error:
            counts["not built"] += 1
            rows.append(f"| {family.name} | not built: {family.error} | | |")
            continue
        model = build(family)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups = route_parameters(model)
        first: dict[str, str] = {}
        for stack in groups.experts.values():
            leaf = ".".join(stack.name.split(".")[-2:])  # owner.param: JetMoE's input_linear.weight
            how = stack.found_by.split(" (")[0]
            first.setdefault(leaf, f"`{leaf}` {stack.layout.describe(stack.shape)} ({how})")
        hows = {s.found_by.split(" (")[0] for s in groups.experts.values()}
        for how in ("unread", "probe", "metadata"):
            if any(h.startswith(how) for h in hows):
                counts[how] += 1
                break
        routers = sorted(
            {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n, r in groups.assignments.items() if r == "routers"}
        )
        warned = sum("route_parameters" in str(w.message) for w in caught)
        classes = ", ".join(family.experts_classes)
        rows.append(
            f"| {family.name} | {classes} | {'; '.join(first.values())} | {', '.join(routers) or '-'}"
            + (f" ({warned} warnings)" if warned else "")
            + " |"
        )
    total = len(rows)
    print(
        f"transformers {transformers.__version__}: {total} families; layouts read from metadata in "
        f"{counts['metadata']}, by the probe in {counts['probe']}, unread (warned) in {counts['unread']}; "
        f"{counts['not built']} not built\n"
    )
    print("| family | experts classes | stacks: layout (decided by) | routers (to AdamW) |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------- replicas


class _ReplicaConfig:
    vocab_size = 96
    hidden_size = H


class _Replica(nn.Module):
    """An embedding, one MoE block and a head: a storage class the installed transformers lacks, written as
    its model file writes it (``forward(input_ids, **kwargs)``)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.config = _ReplicaConfig()
        self.embed = nn.Embedding(96, H)
        self.block = block
        self.lm_head = nn.Linear(H, 96, bias=False)

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        return self.lm_head(self.block(self.embed(input_ids)))


class ConcatExpertsGLU(nn.Module):
    """DBRX's storage: ``w1``, ``v1`` ``(E * F, H)`` as ``(F, H)`` per expert, ``w2`` ``(E * F, H)`` as ``(F, H)``
    used ``h @ w2[e]``, i.e. stored ``(in, out)``; the experts' count on the module."""

    def __init__(self, experts: int = EXPERTS, ffn: int = INTER) -> None:
        super().__init__()
        self.moe_num_experts, self.ffn = experts, ffn
        self.w1 = nn.Parameter(torch.randn(experts * ffn, H) * 0.1)
        self.v1 = nn.Parameter(torch.randn(experts * ffn, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts * ffn, H) * 0.1)

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            for k in range(index.shape[1]):
                e = int(index[t, k])
                w1, v1, w2 = (w.view(-1, self.ffn, H)[e] for w in (self.w1, self.v1, self.w2))
                h = nn.functional.silu(hidden[t] @ w1.T) * (hidden[t] @ v1.T)
                out[t] = out[t] + weights[t, k] * (h @ w2)
        return out


class SharedStackExperts(nn.Module):
    """Inkling's shared experts: ``(n_shared, I, H)`` gate and up, ``(n_shared, H, I)`` down; every token
    goes through each."""

    def __init__(self, shared: int = 1) -> None:
        super().__init__()
        self.n_shared_experts = shared
        self.gate_proj = nn.Parameter(torch.randn(shared, INTER, H) * 0.1)
        self.up_proj = nn.Parameter(torch.randn(shared, INTER, H) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(shared, H, INTER) * 0.1)

    def forward(self, hidden: Tensor, gammas: Tensor) -> Tensor:
        x = hidden.unsqueeze(0).expand(self.n_shared_experts, -1, -1)
        h = nn.functional.silu(torch.bmm(x, self.gate_proj.transpose(1, 2))) * torch.bmm(
            x, self.up_proj.transpose(1, 2)
        )
        return (torch.bmm(h * gammas.T.unsqueeze(-1), self.down_proj.transpose(1, 2))).sum(0)


class _ReplicaBlock(nn.Module):
    def __init__(self, experts: nn.Module, shared: bool) -> None:
        super().__init__()
        self.router = nn.Sequential(nn.Linear(H, EXPERTS, bias=False))
        self.experts = experts
        self.shared = shared

    def forward(self, hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, H)
        scores = self.router(flat).softmax(-1)
        if self.shared:
            return self.experts(flat, scores[:, :1]).view_as(hidden)
        weights, index = torch.topk(scores, 1, dim=-1)  # DBRX's default: top-1
        return self.experts(flat, index, weights).view_as(hidden)


def replica(kind: str) -> tuple[Family, nn.Module]:
    """``"concat"`` (DBRX's 2-D storage) or ``"shared"`` (Inkling's shared stacks), in a tiny model."""
    torch.manual_seed(0)
    experts = ConcatExpertsGLU() if kind == "concat" else SharedStackExperts()
    family = Family("replica", f"replica of {type(experts).__name__}", (type(experts).__name__,))
    return family, _Replica(_ReplicaBlock(experts, shared=kind == "shared")).eval()
