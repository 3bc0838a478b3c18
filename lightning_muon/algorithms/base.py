"""The algorithm registry: what a param group's ``"algorithm"`` names, and how to add one.

``Muon`` steps every param group with the ``Algorithm`` registered under the group's
``"algorithm"`` key. An algorithm is one object that knows its settings (a
``Settings`` dataclass whose fields are the group keys it reads, with their defaults and
checks), what a new group needs, and how to step a group::

    Muon.add_param_group(group)
        algorithm = get_algorithm(group["algorithm"])   # or the one its tensors imply
        group <- algorithm.group_defaults(settings)      # the settings from Muon(...) / MuonConfig
        algorithm.check(group's own values)              # aliases renamed; a bad value names the key
        algorithm.init_group(group, params)              # shapes, derived keys
    Muon.step()
        algorithm.step_group(ctx, group, params, grads)  # per group, in group order: init_state, then the update
        algorithm.finish_step(ctx, groups)               # per algorithm that has one, after every group
    torch's distributed checkpoint, on a new optimizer
        algorithm.init_state(ctx, group, params)         # per group: the state, and nothing moves

``ctx`` is the optimizer's ``StepContext``: its state, its settings, the sharding and the
update hooks, and nothing else of it.

The built-in algorithms (all 14: ``algorithm_names()``) register themselves at the bottom of
their modules in this package; a user's algorithm, in a
file of its own, does the same with ``register_algorithm`` and is then a name like any
other, in a param group, a routing ``Rule`` and YAML.

References:
    Megatron-Core ``emerging_optimizers``: one ``EmergingOptimizerEntry`` per optimizer,
    registered at the bottom of the module.
    NVIDIA-NeMo Emerging-Optimizers: one ``OrthogonalizedOptimizer`` base with pre- and
    post-weight-update hooks, and a file per variant.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from lightning_muon.algorithms.checks import HparamError
from lightning_muon.algorithms.settings import Settings
from lightning_muon.aliases import aliases_of, build_settings, settings_from

if TYPE_CHECKING:
    from lightning_muon.distributed.protocol import Sharding

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "StepContext",
    "algorithm_names",
    "get_algorithm",
    "get_algorithm_of_kind",
    "group_lr",
    "orthogonalizes",
    "per_matrix",
    "register_algorithm",
    "settings_by_algorithm",
]


class StepContext:
    """What an algorithm's step may use of its optimizer: state, settings, sharding, update hooks, memory cap.

    ``Muon`` makes one for its lifetime and sets its attributes at the start of every step
    (so they follow ``load_state_dict``, which replaces the state, and ``attach_sharding``); it
    hands it to every ``Algorithm`` method that steps, and the algorithm sees nothing else of the
    optimizer. It is a weak-referenceable, hashable handle: an algorithm may key per-optimizer
    caches by it (Schedule-Free keeps its inner optimizer so).
    """

    __slots__ = ("state", "state_settings", "sharding", "update_hooks", "caps", "groups", "beta1s", "__weakref__")

    def __init__(self) -> None:
        self.state: Any = None
        """The per-parameter state (``optimizer.state``: a ``defaultdict(dict)`` keyed by tensor), saved with it."""
        self.state_settings: Any = None
        """The optimizer's ``StateSettings``: state dtypes, ``step_memory_mb``, ..."""
        self.sharding: Sharding | None = None
        """The ``Sharding`` that splits per-matrix work across ranks, or None (one process)."""
        self.update_hooks: dict[int, Any] = {}
        """``Muon.register_update_hook``'s hooks, in registration order (empty: none)."""
        self.caps: dict[str, int | None] = {}
        """The step's memory cap in bytes per device type (``step_memory.step_memory_bytes``), resolved once."""
        self.groups: list[dict[str, Any]] = []
        """The optimizer's param groups (for messages: ``group_index``)."""
        self.beta1s: dict[int, float] = {}
        """Each Adam-like group's beta1 at its last step, by ``id(group)`` (``adamw.sync_beta1``)."""

    def local_shard(self, t: Tensor) -> Tensor:
        """This rank's part of ``t`` (a DTensor's local shard under a sharding); ``t`` itself in one process."""
        return t if self.sharding is None else self.sharding.local_shard(t)

    @property
    def has_update_hooks(self) -> bool:
        """True when an update hook is registered (``Muon.register_update_hook``)."""
        return bool(self.update_hooks)

    def run_update_hooks(
        self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor], ortho: list[list[Tensor]]
    ) -> None:
        """Call every update hook on one round of a matrix group's updates, in registration order.

        A copy of the list: a hook may remove itself.
        """
        for hook in list(self.update_hooks.values()):
            hook(group, params, updates, ortho)

    def group_index(self, group: dict[str, Any]) -> int:
        """The position of ``group`` among the optimizer's param groups (for messages)."""
        return next(i for i, g in enumerate(self.groups) if g is group)


def group_lr(group: Mapping[str, Any]) -> float:
    """A group's lr as a Python number, what a step's arithmetic takes.

    A Tensor lr (``Muon(params, lr=torch.tensor(1e-3))``, as torch.optim.Muon accepts it) stays a
    Tensor in the group, where an LR scheduler ``fill_``s it; a step reads its value here
    (``item()``, one device sync for a CUDA lr), so a Tensor lr steps as the same float does.
    """
    lr = group["lr"]
    return lr.item() if isinstance(lr, Tensor) else lr


# Keys a param group always has, whatever its algorithm: no hyperparameter may take them.
RESERVED_KEYS = frozenset({"params", "algorithm", "name", "param_names"})
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Algorithm:
    """One update rule for ``Muon``'s param groups: its hyperparameters, their checks, its state and its step.

    Subclass it in a module of its own: set ``name`` and ``settings``, write ``step_group``, and
    register an instance with ``register_algorithm`` (or decorate the class with it). The other
    methods have defaults that suit an elementwise rule; the built-ins override what they need.
    The per-parameter state lives in ``ctx.state[p]`` (saved and loaded with the
    optimizer), the hyperparameters in the group, so a checkpoint holds everything.

    Class attributes:
        name: the group's ``"algorithm"`` value; a Python identifier.
        settings: a ``Settings`` dataclass whose fields are the group keys this algorithm reads,
            with their defaults; constructing it checks values (``algorithms.settings``).
        orthogonalizes: True for Muon and its variants: their groups hold matrices whose
            updates are orthogonalized, their ``momentum`` is Muon's (the momentum warmup
            drives it) and the update hooks observe them.
        per_matrix: True when the work is per whole matrix (Newton-Schulz, SOAP's
            eigenbases): the algorithm takes the hidden matrices (``MuonConfig.matrix``, not
            ``scalar``) and a ``Sharding`` gives each matrix to one owner rank.
            Every orthogonalizing algorithm is one.
        follows_falloff: False when the lr schedule applies only its warmup to these groups
            (Schedule-Free AdamW averages its iterates instead of decaying the lr).
        layout_options: group keys besides the hyperparameters (Muon: ``split_sizes``, ...).
        state_dtype_settings: the optimizer-wide state settings (``exp_avg_dtype``,
            ``exp_avg_sq_dtype``, ``main_params_dtype``; ``state_dtypes``) this algorithm
            honours, or has no state for. ``Muon`` refuses a group of an algorithm when a
            setting it does not list is away from its default, so none is silently ignored;
            an algorithm that lists one reads it from ``ctx.state_settings``
            (``state_dtypes.state_dtype``).
    """

    name: ClassVar[str] = ""
    settings: ClassVar[type[Settings]] = Settings
    orthogonalizes: ClassVar[bool] = False
    per_matrix: ClassVar[bool] = False
    follows_falloff: ClassVar[bool] = True
    layout_options: ClassVar[frozenset[str]] = frozenset()
    state_dtype_settings: ClassVar[frozenset[str]] = frozenset()

    # ------------------------------------------------------------------ hyperparameters

    def option_names(self) -> frozenset[str]:
        """The keys a param group of this algorithm may set: its settings, layout, ``name``, ``param_names``."""
        fields = (f.name for f in dataclasses.fields(self.settings))  # fixed ones too: a group holds them
        names = {*fields, *aliases_of(self.settings)}  # other projects' names too (aliases)
        return frozenset({"name", "param_names", *names, *self.layout_options})

    def make_settings(self, values: Mapping[str, Any], where: str = "Muon()") -> Settings:
        """``settings`` from ``values`` in our names or other projects' (``aliases.settings_from``), checked."""
        return settings_from(self.settings, values, where)

    def check(self, values: Mapping[str, Any], where: str) -> dict[str, Any]:
        """Check the settings in ``values`` (a group, its aliases already renamed: ``Muon.add_param_group``);
        returns the normalized ones to store.

        ``where`` starts every message (``"Muon()"``, ``"param group 2 ('muon')"``). Raises ``HparamError``.
        """
        fields = self.settings.field_names()  # not the fixed ones: ``init_group`` refuses another value of those
        return build_settings(self.settings, {k: v for k, v in values.items() if k in fields}, where).arguments()

    def group_defaults(self, settings: Settings) -> dict[str, Any]:
        """The values a new group of this algorithm starts from: its ``settings`` (the optimizer's for it)."""
        return settings.asdict()

    # ------------------------------------------------------------------ groups

    def init_group(self, group: dict[str, Any], params: list[Tensor], where: str) -> None:
        """Check ``params`` against the group and add derived keys (in place); called once per new group."""

    # ------------------------------------------------------------------ steps

    def init_state(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor]) -> None:
        """Make the state ``params`` (of ``group``) lack, moving nothing: torch's ``_init_group`` convention.

        ``step_group`` calls it first; ``Muon`` calls it alone for every group when torch's
        distributed checkpoint asks for a new optimizer's state (a step at zero gradients and lr
        0), so a checkpoint can be loaded into it. The state it makes is the state a first step
        would find: the same keys, shapes, dtypes and layouts.
        """

    def step_group(self, ctx: StepContext, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> None:
        """Update ``params`` (those of ``group`` with a gradient, this rank's to step) from ``grads``."""
        raise NotImplementedError(f"algorithm {self.name!r} has no step_group")

    finish_step: ClassVar[Any] = None
    """None, or ``finish_step(ctx, groups)``: what runs once per step after every group was stepped, with all of
    this algorithm's groups (Schedule-Free steps them together there)."""

    def train(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        """``Muon.train()``: the groups' parameters to their training values (a no-op unless overridden)."""

    def eval(self, ctx: StepContext, groups: list[dict[str, Any]]) -> None:
        """``Muon.eval()``: the groups' parameters to their evaluation values (a no-op unless overridden)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_REGISTRY: dict[str, Algorithm] = {}
ALGORITHMS: Mapping[str, Algorithm] = _REGISTRY
"""Every registered algorithm by name, what ``Muon.step`` looks a group's ``"algorithm"`` up in (read it; add with
``register_algorithm``)."""


def register_algorithm(algorithm: Algorithm | type[Algorithm], *, replace: bool = False) -> Any:
    """Register ``algorithm`` (an ``Algorithm`` instance, or a subclass to instantiate) under its ``name``.

    Returns what it was given, so it also decorates a class. A name already registered raises
    unless ``replace=True``. From then on ``name`` may be a param group's ``"algorithm"``, a
    ``Rule``'s ``algorithm``, and its ``settings`` a ``MuonConfig`` section (``matrix``, ``scalar``
    or ``others``) or one of ``Muon(settings=...)``.

    Raises:
        TypeError: not an ``Algorithm``, or ``settings`` is not a ``Settings`` dataclass.
        ValueError: a bad or taken name, a setting named like a reserved group key,
            or no ``step_group``.
    """
    is_class = isinstance(algorithm, type)
    if not (issubclass(algorithm, Algorithm) if is_class else isinstance(algorithm, Algorithm)):
        raise TypeError(f"register_algorithm: expected an Algorithm or a subclass of it, got {algorithm!r}")
    instance = algorithm() if is_class else algorithm
    name = instance.name
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"register_algorithm: {type(instance).__name__}.name must be an identifier, got {name!r}")
    settings = instance.settings
    if not (isinstance(settings, type) and issubclass(settings, Settings) and dataclasses.is_dataclass(settings)):
        raise TypeError(
            f"register_algorithm: {name!r}: settings must be a dataclass deriving from "
            f"lightning_muon.algorithms.Settings, got {settings!r}"
        )
    clash = sorted(RESERVED_KEYS & set(settings.field_names()))
    if clash:
        raise ValueError(f"register_algorithm: {name!r}: settings {clash} are reserved group keys")
    if type(instance).step_group is Algorithm.step_group:
        raise ValueError(f"register_algorithm: {name!r} does not define step_group")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"register_algorithm: {name!r} is registered already ({_REGISTRY[name]!r}); pass replace=True to replace it"
        )
    _REGISTRY[name] = instance
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered under ``name``, or at the import path ``name`` (``"my_pkg.rules.Signum"``).

    An import path names an ``Algorithm`` subclass or instance in an importable module; it is
    registered under its own ``name`` on first use, so a YAML config can name an algorithm
    that nothing imported yet. A ``ValueError`` lists the registered names.
    """
    algorithm = _REGISTRY.get(name) if isinstance(name, str) else None
    if algorithm is None and isinstance(name, str) and "." in name:
        algorithm = _import(name)
    if algorithm is None:
        raise ValueError(
            f"algorithm must be one of {algorithm_names()}, got {name!r} (an algorithm of your own: "
            "register it with lightning_muon.register_algorithm, or name it by its import path)"
        )
    return algorithm


def _import(path: str) -> Algorithm:
    module, _, attr = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"algorithm {path!r} cannot be imported: {err}") from None
    if isinstance(found, type) and issubclass(found, Algorithm):
        registered = _REGISTRY.get(found.name)
        if type(registered) is found:  # the module registered it when imported
            return registered
        return _REGISTRY[register_algorithm(found()).name]
    if isinstance(found, Algorithm):
        if _REGISTRY.get(found.name) is not found:
            register_algorithm(found)
        return found
    raise ValueError(f"algorithm {path!r} is {found!r}, not an Algorithm subclass or instance")


def get_algorithm_of_kind(name: str, matrix: bool, what: str) -> Algorithm:
    """``get_algorithm(name)`` for a role that needs an algorithm of (not of) whole matrices (``per_matrix``).

    ``what`` names the setting in the error (``"scalar_algorithm"``), which lists the choices.
    """
    try:
        algorithm = get_algorithm(name)
    except ValueError:
        algorithm = None
    if algorithm is None or algorithm.per_matrix != matrix:
        raise ValueError(f"{what} must be one of {algorithm_names(matrix=matrix)}, got {name!r}")
    return algorithm


def algorithm_names(orthogonal: bool | None = None, matrix: bool | None = None) -> tuple[str, ...]:
    """Registered names in registration order; ``orthogonal`` keeps only those that (do not) orthogonalize,
    ``matrix`` those that are (not) ``per_matrix``."""
    return tuple(
        n
        for n, a in _REGISTRY.items()
        if (orthogonal is None or a.orthogonalizes == orthogonal) and (matrix is None or a.per_matrix == matrix)
    )


def per_matrix(group: Mapping[str, Any] | str) -> bool:
    """True when a group's algorithm (or the algorithm of that name) works per whole matrix (``Algorithm.per_matrix``).

    A ``Sharding`` gives those groups' matrices to owner ranks. False for a group without an
    algorithm or an unknown name.
    """
    name = group if isinstance(group, str) else group.get("algorithm")
    algorithm = _REGISTRY.get(name) if isinstance(name, str) else None
    if algorithm is None and isinstance(name, str) and "." in name:
        algorithm = get_algorithm(name)
    return algorithm is not None and algorithm.per_matrix


def orthogonalizes(group: Mapping[str, Any] | str) -> bool:
    """True when a group's algorithm (or the algorithm of that name) is Muon or a variant of it.

    False for a group without one (another optimizer's) or an unknown name.
    """
    name = group if isinstance(group, str) else group.get("algorithm")
    algorithm = _REGISTRY.get(name) if isinstance(name, str) else None  # the hot path: a dict lookup
    if algorithm is None and isinstance(name, str) and "." in name:
        algorithm = get_algorithm(name)
    return algorithm is not None and algorithm.orthogonalizes


def settings_by_algorithm(settings: Iterable[Settings], where: str = "settings") -> dict[str, Settings]:
    """``settings`` by the algorithm each is for; two for one algorithm, or one for no algorithm, raise."""
    out: dict[str, Settings] = {}
    for s in settings:
        name = getattr(s, "algorithm", "")
        if not isinstance(s, Settings) or not name:
            kind = type(s).__name__
            raise HparamError(
                f"{where}: expected the settings of an algorithm (MuonSettings, AdamWSettings, ...), got {kind}", where
            )
        if name in out:
            raise HparamError(f"{where}: two settings for {name!r}: {out[name]!r} and {s!r}", where)
        out[get_algorithm(name).name] = s
    return out
