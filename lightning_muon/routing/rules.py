"""Routing parameters to algorithms: ordered, named rules; the first match wins.

``route_parameters(module)`` walks ``module.named_parameters()`` and gives every
trainable parameter to the first rule that matches it. User rules come first,
then the default rules:

1. ``vectors``: 1-D and 0-D parameters (biases, norms, scalars) -> AdamW without
   weight decay (group ``adamw_no_decay``); ``biases``: every parameter named as a bias
   (``bias``, ``*_bias``: GPT-OSS's 2-D expert bias stacks), whatever its ndim, likewise.
2. ``embedding``: weights of ``nn.Embedding`` modules, and anything tied to one, and the
   trainable tensors of a layer wrapping one as its ``base_layer`` (peft's LoRA on an
   embedding, ``lora_embedding_A``/``B``; its trainable tokens, ``trainable_tokens_delta``)
   -> AdamW (group ``adamw``).
3. ``output_head``: the head -> AdamW (group ``adamw``): the parameters of
   ``module.get_output_embeddings()`` when the module has it, else a Linear whose
   attribute name is one of ``head_names``, else (``head_by_position``) the last
   ``nn.Linear`` registered in the module.
   If the module offers ``get_classifier()`` (timm), its classifier is the head too (a
   Linear or a 1x1 convolution). With no head found, a warning says so.
   ``routers``: every parameter a mixture of experts' routing depends on (``experts.find_experts``)
   -> AdamW (``router_algorithm`` changes it): E outputs read through a per-token softmax.
   ``expert_stacks``: mixture-of-experts stacks (``experts.find_experts``: their layouts read
   from transformers' metadata or the model's own forward) -> Muon as batches of per-expert
   matrices (``batched=True``, their orientation, the fused gate/up split in two unless
   ``split_gate_up=False``), groups ``muon_experts*``. A stack whose layout could not be read
   is routed ``(E, out, in)`` with a warning that names it and the ``Rule`` that fixes it.
4. ``token_tables``: tensors whose (dim 0, rest) matrix view has a side of 1, like timm's
   ``pos_embed`` (1, N, D) and ``cls_token`` (1, 1, D), and parameters named as position
   or token tables (``TOKEN_TABLE_NAMES``) -> AdamW: Muon would orthogonalize a vector.
5. ``input_layer`` (only with ``input_layer=True``): the first convolution or Linear
   weight (a convnet's stem), as many Muon recipes keep it -> AdamW.
6. ``aspect_ratio`` (only with ``max_aspect_ratio``): matrices whose long side is
   more than that many times the short side -> AdamW.
7. ``hidden_matrices_transposed``: weights stored (fan_in, fan_out) by a module type in
   ``TRANSPOSED_MODULES`` (transformers' ``Conv1D``, GPT-2) -> Muon with ``transposed=True``
   (group ``muon_transposed``), so the lr scale reads fan_out and fan_in the right way round.
8. ``hidden_matrices``: every other parameter (>= 2 dims) -> Muon (group ``muon``).

``scalar_algorithm`` replaces AdamW in the default rules (``"lion"``, ``"adamw_schedulefree"``
or a registered algorithm of your own; the groups take its name) and ``matrix_algorithm``
replaces Muon (a registered variant such as ``"muon_hyperball"``). A rule's ``algorithm`` is
any registered name, or the import path of an ``Algorithm`` (registered on first use).

Frozen parameters (``requires_grad=False``) are left out. Within a rule, several
values of one matcher are alternatives (any glob may match); different matchers
must all match (a name glob AND a module type). A name glob or regex also matches a name
written without the ``_orig_mod.`` that ``torch.compile`` puts in the names of a compiled
submodule's parameters.

``route_names(pairs)`` routes ``(name, tensor)`` pairs without their module (``Muon(model.named_parameters())``)
by the same default rules, from what the names show: embeddings and token tables by their
module's name (``EMBEDDING_NAMES``), the head by its module's name (``DEFAULT_HEAD_NAMES``) or,
where none is, the last matrix listed when its name holds one of them (``net.head.fc.weight``).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import importlib
import re
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_muon.algorithms import get_algorithm, get_algorithm_of_kind, orthogonalizes
from lightning_muon.layout import MatrixLayout, layout_of
from lightning_muon.routing.conv1d import TRANSPOSED_MODULES, transposed_weights
from lightning_muon.routing.experts import EXPERT_ORIENTATIONS, ExpertStack, find_experts, is_bias

__all__ = [
    "DEFAULT_HEAD_NAMES",
    "EMBEDDING_NAMES",
    "TOKEN_TABLE_NAMES",
    "TRANSPOSED_MODULES",
    "ParamGroups",
    "Rule",
    "route",
    "route_names",
    "unwrap_module",
]

DEFAULT_HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "output_projection", "classifier", "fc_out")
# Parameter names of learned position and token tables (timm ViT, DeiT, BEiT, MAE).
TOKEN_TABLE_NAMES = (
    r"(^|\.)(pos_embed|pos_embedding|position_embeddings?|cls_token|dist_token|reg_token|register_tokens|mask_token)$"
)
# The name of a module holding an embedding table, as models write it (the part of a parameter's name
# before its own): embed_tokens, word_embeddings, wte, tok_embeddings, embed_in, and peft's adapters of one.
EMBEDDING_NAMES = (
    r"^((.*_)?(wte|wpe|emb|embed|embeds|embedding|embeddings)(_.*)?|.*embeddings|lora_embedding_[AB]"
    r"|trainable_tokens_delta)$"
)
_STEM_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, type)) or callable(value):
        return (value,)
    return tuple(value)


@functools.cache
def _import(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def _check_importable(value: Any, what: str, rule: str) -> None:
    if value is None or callable(value) or isinstance(value, type):
        return
    if not isinstance(value, str) or "." not in value:
        raise ValueError(f"Rule {rule!r}: {what} must be a callable or a dotted import path, got {value!r}")
    try:
        _import(value)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"Rule {rule!r}: {what} {value!r} cannot be imported: {err}") from None


def _call(fn: Callable | str, *args: Any) -> bool:
    return bool((_import(fn) if isinstance(fn, str) else fn)(*args))


def _check_option_names(rule: str, algorithm: str, options: dict[str, Any]) -> None:
    """A typo in an option would become a group key nobody reads: refuse it, with the closest valid name."""
    valid = get_algorithm(algorithm).option_names()
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"Rule {rule!r}: option {key!r} is not a hyperparameter of {algorithm!r} groups{hint} "
                f"(valid: {sorted(valid)})"
            )


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One routing rule: which parameters it matches and where they go."""

    name: str
    """Rule name, shown in the routing report and in errors."""
    algorithm: str
    """A registered algorithm (``"muon"``, ``"adamw"``, ``"lion"``, ``"adamw_schedulefree"``, ...) or an
    ``Algorithm``'s import path."""
    names: str | tuple[str, ...] = ()
    """Glob patterns (``fnmatch``) on the full parameter name, e.g. ``"*.attn.qkv.weight"``."""
    regex: str | None = None
    """A regular expression searched in the full parameter name."""
    module_types: str | type | tuple[str | type, ...] = ()
    """The owning module's class, its name (``"LayerNorm"``) or a dotted path; subclasses match."""
    attributes: str | tuple[str, ...] = ()
    """Parameter attributes; the rule matches when any is set and truthy (Megatron's ``attr``)."""
    min_ndim: int | None = None
    """Match only parameters with at least this many dims."""
    max_ndim: int | None = None
    """Match only parameters with at most this many dims."""
    predicate: Callable[[Tensor], bool] | str | None = None
    """``fn(param) -> bool`` or a dotted import path to one."""
    named_predicate: Callable[[Tensor, str], bool] | str | None = None
    """``fn(param, name) -> bool`` or a dotted import path to one."""
    group: str | None = None
    """Param group name; defaults to the rule's name. Rules may share a group if they agree."""
    options: dict[str, Any] = field(default_factory=dict)
    """Per-group hyperparameters (``lr``, ``weight_decay``, ``split_sizes``, ...)."""
    experts: str | None = None
    """The matched tensors are mixture-of-experts stacks, ``(E, out, in)`` (``"out_in"``) or
    ``(E, in, out)`` (``"in_out"``): each expert's matrix is orthogonalized alone
    (``batched=True`` and the orientation; add ``split_parts: 2`` to ``options`` for a fused
    gate/up of concatenated halves, ``split_sizes: [1, 1]`` for interleaved ones)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Rule.name must be a non-empty string, got {self.name!r}")
        try:
            get_algorithm(self.algorithm)
        except ValueError as err:
            raise ValueError(f"Rule {self.name!r}: {err}") from None
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as err:
                raise ValueError(f"Rule {self.name!r}: regex {self.regex!r} is invalid: {err}") from None
        if not isinstance(self.options, dict):
            raise ValueError(f"Rule {self.name!r}: options must be a dict, got {self.options!r}")
        if "params" in self.options or "algorithm" in self.options:
            raise ValueError(f"Rule {self.name!r}: options may not set 'params' or 'algorithm'")
        _check_option_names(self.name, self.algorithm, self.options)
        if self.experts is not None:
            if self.experts not in EXPERT_ORIENTATIONS:
                raise ValueError(
                    f"Rule {self.name!r}: experts must be one of {sorted(EXPERT_ORIENTATIONS)} or None, "
                    f"got {self.experts!r}"
                )
            if not orthogonalizes(get_algorithm(self.algorithm).name):
                raise ValueError(f"Rule {self.name!r}: experts= needs a Muon algorithm, got {self.algorithm!r}")
            clash = sorted({"batched", "transposed"} & set(self.options))
            if clash:
                raise ValueError(f"Rule {self.name!r}: experts= sets {clash} itself; leave them out of options")
        # Dotted paths stay strings (checkpoints keep plain data); they are imported on use.
        _check_importable(self.predicate, "predicate", self.name)
        _check_importable(self.named_predicate, "named_predicate", self.name)
        for t in _as_tuple(self.module_types):
            if isinstance(t, str) and "." in t:
                _check_importable(t, "module_types entry", self.name)
            elif not isinstance(t, (str, type)):
                raise ValueError(f"Rule {self.name!r}: module_types entries must be classes or names, got {t!r}")

    @property
    def group_name(self) -> str:
        return self.group or self.name

    def to_dict(self) -> dict[str, Any]:
        """The fields this rule sets away from their defaults (the form YAML writes it in)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    @property
    def group_options(self) -> dict[str, Any]:
        """The options its group takes: ``options``, and the layout ``experts`` implies."""
        if self.experts is None:
            return dict(self.options)
        return {**self.options, "batched": True, "transposed": EXPERT_ORIENTATIONS[self.experts]}

    def matches(self, param: Tensor, name: str, owner: nn.Module | None) -> bool:
        """True when every matcher the rule sets accepts ``param`` (named ``name``)."""
        written = (name, name.replace("_orig_mod.", "")) if "_orig_mod." in name else (name,)  # torch.compile's
        names = _as_tuple(self.names)
        if names and not any(fnmatch.fnmatchcase(n, pattern) for n in written for pattern in names):
            return False
        if self.regex is not None and all(re.search(self.regex, n) is None for n in written):
            return False
        types = _as_tuple(self.module_types)
        if types and not _owner_matches(owner, types):
            return False
        attributes = _as_tuple(self.attributes)
        if attributes and not any(getattr(param, a, False) for a in attributes):
            return False
        if self.min_ndim is not None and param.ndim < self.min_ndim:
            return False
        if self.max_ndim is not None and param.ndim > self.max_ndim:
            return False
        if self.predicate is not None and not _call(self.predicate, param):
            return False
        return self.named_predicate is None or _call(self.named_predicate, param, name)


def _owner_matches(owner: nn.Module | None, types: tuple) -> bool:
    if owner is None:
        return False
    mro_names = {cls.__name__ for cls in type(owner).__mro__}

    def one(t: str | type) -> bool:
        if isinstance(t, str) and "." in t:
            t = _import(t)
        return isinstance(owner, t) if isinstance(t, type) else t in mro_names

    return any(one(t) for t in types)


class ParamGroups(list):
    """The param-group dicts ``Muon`` takes, plus ``assignments`` and ``report()``."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        assignments: dict[str, str],
        notes: dict[str, str] | None = None,
        experts: dict[str, ExpertStack] | None = None,
        idle_rules: list[Rule] | None = None,
    ) -> None:
        super().__init__(groups)
        self.assignments = assignments
        """Parameter name -> the rule that routed it."""
        self.notes = notes or {}
        """Rule name -> how it decided, shown beside it in the report (how the head was found)."""
        self.experts = experts or {}
        """Parameter name -> its ``ExpertStack``, for every expert stack routed as one (to Muon)."""
        self.idle_rules = list(idle_rules or [])
        """The user's rules that routed no tensor (each warned about); the report shows them with 0 tensors."""

    def report(self, max_examples: int = 3) -> str:
        """A table, one row per (group, rule): the algorithm, the layout, tensors, elements and examples.

        ``layout`` is ``out,in`` for weights stored like nn.Linear's, ``in,out(T)`` for those
        stored the other way round (``transposed``), ``Ex(...)`` for a batch of ``E`` expert
        matrices, ``/k`` for ``k`` pieces of a split, ``-`` for non-Muon groups. Only the
        examples hold spaces, so the other columns split on whitespace. Expert stacks follow
        the table, one line each: E, the stored shape and the pieces Newton-Schulz sees.
        """
        rows = [("group", "algorithm", "rule", "layout", "tensors", "elements", "examples")]
        for g in self:
            by_rule: dict[str, list[int]] = {}
            for j, name in enumerate(g.get("param_names", [])):
                by_rule.setdefault(self.assignments.get(name, "?"), []).append(j)
            if not by_rule:  # groups built without names
                by_rule = {"?": list(range(len(g["params"])))}
            layout = (
                "-" if not orthogonalizes(g) else layout_of(g).describe(g["params"][0].shape if g["params"] else None)
            )
            for rule, idx in by_rule.items():
                rule = f"{rule}:{self.notes[rule]}" if rule in self.notes else rule
                names = [g["param_names"][j] for j in idx] if "param_names" in g else []
                examples = ", ".join(names[:max_examples]) + (", ..." if len(names) > max_examples else "")
                elements = sum(g["params"][j].numel() for j in idx)
                rows.append((g["name"], g["algorithm"], rule, layout, str(len(idx)), f"{elements:,}", examples))
        for r in self.idle_rules:
            rows.append((r.group_name, get_algorithm(r.algorithm).name, r.name, "-", "0", "0", "(matches no tensor)"))
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(6)) + "  " + r[6] for r in rows]
        if self.experts:
            lines += [f"Expert stacks ({len(self.experts)}): name  E  stored shape -> pieces (E x rows x cols)"]
            lines += ["  " + stack.describe() for stack in self.experts.values()]
        return "Muon routing\n" + "\n".join(lines)


def _head_params(module: nn.Module, head_names: tuple[str, ...], by_position: bool) -> tuple[set[int], str]:
    """The head's parameter ids, and how it was found (shown in the routing report)."""
    for method in ("get_output_embeddings", "get_classifier"):  # transformers, timm
        for sub in module.modules():  # the model itself, or the first submodule that knows its head
            get_head = getattr(sub, method, None)
            try:
                head = get_head() if callable(get_head) else None
            except (TypeError, NotImplementedError):  # a method of that name with other arguments
                head = None
            if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
                return {id(p) for p in head.parameters()}, f"{method}()"
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    named = [m for name, m in linears if name.rsplit(".", 1)[-1] in head_names]
    if named:
        return {id(p) for m in named for p in m.parameters()}, "by_name"
    if by_position and linears:
        return {id(p) for p in linears[-1][1].parameters()}, "last_nn.Linear"
    return set(), "none_found"


def _stem_params(module: nn.Module) -> set[int]:
    """The first convolution or Linear weight registered in ``module`` (a convnet's stem)."""
    for m in module.modules():
        if isinstance(m, _STEM_TYPES) and getattr(m, "weight", None) is not None:
            return {id(m.weight)}
    return set()


def _is_token_table(p: Tensor, name: str) -> bool:
    if p.ndim >= 2 and (p.shape[0] == 1 or p[0].numel() == 1):
        return True  # its matrix view is a row or a column: a vector to Muon
    return re.search(TOKEN_TABLE_NAMES, name) is not None


@dataclass(frozen=True)
class _Found:
    """What ``route_parameters`` found in the module before matching: ids of tensors by role."""

    embeddings: set[int]
    head: set[int]
    stem: set[int] | None
    transposed: set[int]
    routers: set[int]
    stacks: dict[int, ExpertStack]


def _default_rules(max_aspect_ratio: float | None, found: _Found, router_algorithm: str | None) -> list[Rule]:
    no_decay = {"weight_decay": 0.0}
    rules = [
        # Vectors first, so that a head's bias goes without weight decay like every other bias.
        Rule(name="vectors", algorithm="adamw", group="adamw_no_decay", max_ndim=1, options=no_decay),
        Rule(name="biases", algorithm="adamw", group="adamw_no_decay", named_predicate=_named_bias, options=no_decay),
        Rule(name="embedding", algorithm="adamw", group="adamw", predicate=lambda p: id(p) in found.embeddings),
        Rule(name="output_head", algorithm="adamw", group="adamw", predicate=lambda p: id(p) in found.head),
    ]
    if found.routers:
        algorithm = router_algorithm or "adamw"
        group = "adamw" if router_algorithm is None else f"{get_algorithm(algorithm).name}_routers"
        rules.append(Rule(name="routers", algorithm=algorithm, group=group, predicate=lambda p: id(p) in found.routers))
    rules += _expert_rules(found.stacks)
    rules.append(Rule(name="token_tables", algorithm="adamw", group="adamw", named_predicate=_is_token_table))
    if found.stem is not None:
        stem = found.stem
        rules.append(Rule(name="input_layer", algorithm="adamw", group="adamw", predicate=lambda p: id(p) in stem))
    if max_aspect_ratio is not None:
        rules.append(
            Rule(
                name="aspect_ratio",
                algorithm="adamw",
                group="adamw",
                predicate=lambda p: max(p.shape[0], p[0].numel()) > max_aspect_ratio * min(p.shape[0], p[0].numel()),
            )
        )
    rules.append(
        Rule(
            name="hidden_matrices_transposed",
            algorithm="muon",
            group="muon_transposed",
            predicate=lambda p: id(p) in found.transposed,
            options={"transposed": True},
        )
    )
    rules.append(Rule(name="hidden_matrices", algorithm="muon", group="muon", min_ndim=2))
    return rules


def _named_bias(p: Tensor, name: str) -> bool:
    return is_bias(name)


def _expert_rules(stacks: dict[int, ExpertStack]) -> list[Rule]:
    """One Muon rule per distinct expert layout: ``muon_experts[_gate_up][_transposed]``."""
    by_layout: dict[MatrixLayout, set[int]] = {}
    for pid, stack in stacks.items():
        by_layout.setdefault(stack.layout, set()).add(pid)
    names: dict[MatrixLayout, str] = {}
    for layout in by_layout:
        kind = "experts" if layout.split_sizes is None else "experts_gate_up"
        names[layout] = (
            kind + ("_2d" if layout.blocks is not None else "") + ("_transposed" if layout.transposed else "")
        )
    rules = []
    for layout, ids in by_layout.items():
        name = names[layout]
        if list(names.values()).count(name) > 1:  # fused gate/up of several sizes: one group per size
            name += f"_{layout.split_sizes[0]}"
        rules.append(
            Rule(
                name=f"expert_stacks_{name[len('experts_') :]}" if name != "experts" else "expert_stacks",
                algorithm="muon",
                group=f"muon_{name}",
                predicate=lambda p, ids=ids: id(p) in ids,
                options=layout.options(),
            )
        )
    return rules


def unwrap_module(module: nn.Module) -> nn.Module:
    """The model inside wrappers that hold it whole: Fabric's ``_FabricModule`` (its ``.module``), DDP's
    ``DistributedDataParallel`` (``.module``) and ``torch.compile``'s ``OptimizedModule`` (``._orig_mod``).

    Fabric's wrapper is looked for only where Fabric is loaded (no model can be wrapped by it
    otherwise): routing a plain model imports no Lightning.
    """
    from torch.nn.parallel import DistributedDataParallel

    fabric = sys.modules.get("lightning.fabric.wrappers")
    wrappers = (DistributedDataParallel,) if fabric is None else (fabric._FabricModule, DistributedDataParallel)
    while True:
        if isinstance(module, wrappers):
            module = module.module
        elif type(module).__name__ == "OptimizedModule":  # torch._dynamo's, not imported for a name
            module = module._orig_mod
        else:
            return module


def route(
    module: nn.Module,
    settings: Any,
    matrix_algorithm: str = "muon",
    scalar_algorithm: str = "adamw",
    optional_rules: Iterable[Rule] = (),
) -> ParamGroups:
    """Split ``module``'s trainable parameters into named param groups by ``settings``' ordered rules.

    What ``route_parameters`` and ``MuonConfig.route`` run: ``settings`` (a ``RoutingSettings``,
    named by shape here: it is made of this module's rules) holds the rules and the knobs of the
    default rules, ``matrix_algorithm`` and
    ``scalar_algorithm`` are the default rules' two algorithms, and ``optional_rules`` are tried
    after the user's and before the defaults, and may match nothing without a warning
    (``split_qkv``'s, for models without a fused QKV). A wrapper around ``module`` (Fabric's
    ``_FabricModule``, DDP, ``torch.compile``) is looked through, so names and layer types are the
    model's own.

    Names: a rule matches the names of ``module.named_parameters()``, relative to the module
    routed, exactly as the report prints them. Under Lightning the mixin routes the
    LightningModule, so a Hugging Face model held as ``self.model`` has names such as
    ``model.model.layers.0.self_attn.q_proj.weight``. A user rule that routes no tensor gets a
    warning naming it (with an example name it would match once a leading ``model.`` is
    dropped or added, where there is one), and a report row with 0 tensors.

    Returns:
        ``ParamGroups``: dicts with ``params``, ``param_names``, ``algorithm``, ``name`` and the
        rule's options, in first-use order, with ``report()``.

    Raises:
        ValueError: a bad rule; a parameter no rule matches; a user rule sending a
            1-D parameter to Muon; two rules sharing a group with different settings.
    """
    scalar_algorithm = get_algorithm_of_kind(scalar_algorithm, False, "scalar_algorithm").name
    matrix_algorithm = get_algorithm_of_kind(matrix_algorithm, True, "matrix_algorithm").name
    router_algorithm = settings.router_algorithm
    if router_algorithm is not None:
        router_algorithm = get_algorithm(router_algorithm).name
    user_rules = list(settings.rules)
    extra_rules = list(optional_rules)
    module = unwrap_module(module)
    owners = {id(p): m for m in module.modules() for p in m.parameters(recurse=False)}
    embedding_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, nn.Embedding) or isinstance(getattr(m, "base_layer", None), nn.Embedding)  # peft's
        for p in m.parameters()
    }
    head_ids, head_how = _head_params(module, settings.head_names, settings.head_by_position)
    experts = find_experts(module, settings.split_gate_up, settings.probe_experts)
    stacks = experts.stacks
    found = _Found(
        embeddings=embedding_ids,
        head=head_ids,
        stem=_stem_params(module) if settings.input_layer else None,
        transposed=transposed_weights(module),
        routers=experts.routers - head_ids - embedding_ids,
        stacks=stacks,
    )
    defaults = []
    if settings.default_rules:
        defaults = _default_rules(settings.max_aspect_ratio, found, router_algorithm)
        if not head_ids and any(p.ndim >= 2 for p in module.parameters()):
            warnings.warn(
                "route_parameters: no output head found (no get_output_embeddings(), get_classifier(), Linear named "
                f"one of {settings.head_names}, or last nn.Linear); every matrix goes to Muon. Name the head with "
                "head_names or route it with a Rule",
                UserWarning,
                stacklevel=2,
            )
    chosen = {"adamw": scalar_algorithm, "muon": matrix_algorithm}  # the default rules' two algorithms
    defaults = [
        r if chosen.get(r.algorithm, r.algorithm) == r.algorithm else _with_algorithm(r, chosen[r.algorithm])
        for r in defaults
    ]
    user_names = {id(r) for r in user_rules}

    groups: dict[str, dict[str, Any]] = {}
    settings: dict[str, tuple[str, dict]] = {}
    assignments: dict[str, str] = {}
    routed_stacks: dict[str, ExpertStack] = {}
    flattened: list[str] = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        rule = next((r for r in (*user_rules, *extra_rules, *defaults) if r.matches(p, name, owners.get(id(p)))), None)
        if rule is None:
            raise ValueError(f"route_parameters: no rule matches parameter {name!r} of shape {tuple(p.shape)}")
        algorithm = get_algorithm(rule.algorithm).name  # an import path becomes the registered name
        if orthogonalizes(algorithm):
            if p.ndim < 2:
                raise ValueError(
                    f"route_parameters: rule {rule.name!r} sends the {p.ndim}-D parameter {name!r} to Muon; "
                    "Muon needs matrices"
                )
            if id(rule) in user_names and (id(p) in embedding_ids or id(p) in head_ids):
                kind = "embedding" if id(p) in embedding_ids else "output head"
                warnings.warn(
                    f"route_parameters: rule {rule.name!r} sends the {kind} {name!r} to Muon; "
                    "embeddings and heads usually train better with AdamW",
                    UserWarning,
                    stacklevel=2,
                )
        group_name = rule.group_name
        options = rule.group_options
        setting = (algorithm, options)
        if settings.setdefault(group_name, setting) != setting:
            raise ValueError(
                f"route_parameters: rules disagree on group {group_name!r}: "
                f"{settings[group_name]} vs {setting} (from rule {rule.name!r})"
            )
        group = groups.setdefault(
            group_name,
            {"params": [], "param_names": [], "algorithm": algorithm, "name": group_name, **options},
        )
        group["params"].append(p)
        group["param_names"].append(name)
        assignments[name] = rule.name
        if orthogonalizes(algorithm):
            layout = layout_of(options)
            if layout.batched:
                stack = stacks.get(id(p))
                routed_stacks[name] = (
                    stack if stack is not None and stack.layout == layout else _user_stack(name, p, layout, rule)
                )
            elif p.ndim > 2 and not isinstance(owners.get(id(p)), nn.modules.conv._ConvNd):
                flattened.append(f"{name} {tuple(p.shape)}")
    if not groups:
        raise ValueError("route_parameters: the module has no trainable parameters")
    for name, why in experts.unread.items():
        if assignments.get(name, "").startswith(("expert_stacks", "hidden_matrices")):
            warnings.warn(f"route_parameters: {why}", UserWarning, stacklevel=2)
    if flattened:
        warnings.warn(
            f"route_parameters: {len(flattened)} tensor(s) with more than 2 dims are neither a conv kernel nor a "
            f"known expert stack: {', '.join(flattened[:4])}{', ...' if len(flattened) > 4 else ''}. Muon treats "
            "each as one (dim 0, rest) matrix. If one is a stack of matrices (experts), route it with "
            "Rule(..., experts='out_in' or 'in_out')",
            UserWarning,
            stacklevel=2,
        )
    used = set(assignments.values())
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    # A rule for frozen tensors (a backbone that BackboneFinetuning unfreezes later) is not idle.
    idle = [
        r for r in user_rules
        if r.name not in used and not any(r.matches(p, n, owners.get(id(p))) for n, p in frozen)
    ]  # fmt: skip
    for r in idle:
        warnings.warn(_idle_rule_message(r, module, owners, user_rules), UserWarning, stacklevel=2)
    return ParamGroups(groups.values(), assignments, {"output_head": head_how}, routed_stacks, idle)


def route_names(pairs: list[tuple[str, Tensor]]) -> list[dict[str, Any]]:
    """Param groups for ``(name, tensor)`` pairs given without their module, by the default rules (module docstring).

    The groups the module's own routing makes (``adamw_no_decay``, ``adamw``, ``muon``, with
    ``param_names``), from the names alone: where a module type or ``get_output_embeddings()``
    would tell more, ``route_parameters(model)`` reads it.
    """

    def module_name(name: str) -> str:
        return name.replace("_orig_mod.", "").rpartition(".")[0].rpartition(".")[2]

    matrices = [(n, p) for n, p in pairs if p.ndim >= 2]
    embeddings = {id(p) for n, p in matrices if re.match(EMBEDDING_NAMES, module_name(n))}
    head = {id(p) for n, p in matrices if module_name(n) in DEFAULT_HEAD_NAMES}
    if not head and matrices and set(matrices[-1][0].split(".")[:-1]) & set(DEFAULT_HEAD_NAMES):
        head = {id(matrices[-1][1])}
    found = _Found(embeddings=embeddings, head=head, stem=None, transposed=set(), routers=set(), stacks={})
    rules = _default_rules(None, found, None)
    groups: dict[str, dict[str, Any]] = {}
    for name, p in pairs:
        rule = next(r for r in rules if r.matches(p, name, None))
        group = groups.setdefault(
            rule.group_name,
            {"params": [], "param_names": [], "algorithm": rule.algorithm, "name": rule.group_name, **rule.options},
        )
        group["params"].append(p)
        group["param_names"].append(name)
    return list(groups.values())


def _idle_rule_message(rule: Rule, module: nn.Module, owners: dict[int, nn.Module], user_rules: list[Rule]) -> str:
    """Why a user rule routed nothing: it matches no name, or only names an earlier rule took; and a near miss."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    message = f"route_parameters: rule {rule.name!r} matches no tensor"
    taken = [n for n, p in params if rule.matches(p, n, owners.get(id(p)))]
    if taken:
        return f"{message} that an earlier rule did not take first (e.g. {taken[0]!r})"
    for n, p in params:
        for alt in (n.split(".", 1)[1] if "." in n else None, f"model.{n}"):
            if alt is not None and rule.matches(p, alt, owners.get(id(p))):
                return (
                    f"{message}: names are relative to the module routed (as the report prints them); it would "
                    f"match {n!r} written as {alt!r}, so a leading 'model.' is "
                    f"{'missing from' if alt.startswith('model.') and not n.startswith('model.') else 'extra in'} "
                    "its pattern"
                )
    return f"{message} (e.g. the names start {params[0][0]!r} ...)" if params else message


def _user_stack(name: str, p: Tensor, layout: MatrixLayout, rule: Rule) -> ExpertStack:
    return ExpertStack(name, layout.matrix_form(p.shape)[0], tuple(p.shape), layout, f"rule {rule.name}")


def _with_algorithm(rule: Rule, algorithm: str) -> Rule:
    """A default rule sending to ``algorithm`` instead: ``adamw_no_decay`` -> ``lion_no_decay``, ``muon`` -> ``x``.

    Options the algorithm does not take are dropped (a user's rule without weight decay).
    """
    prefix = rule.algorithm
    group = algorithm + rule.group_name[len(prefix) :] if rule.group_name.startswith(prefix) else rule.group_name
    valid = get_algorithm(algorithm).option_names()
    options = {k: v for k, v in rule.options.items() if k in valid}
    fields = {f: getattr(rule, f) for f in rule.__dataclass_fields__}
    return Rule(**{**fields, "algorithm": algorithm, "group": group, "options": options})
