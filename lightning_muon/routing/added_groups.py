"""A param group given without an ``"algorithm"``: routed like the optimizer's own groups, one group per route.

``optimizer.add_param_group({"params": module.parameters(), "lr": ...})`` is how Lightning's
``BackboneFinetuning`` (``BaseFinetuning.unfreeze_and_add_param_group``) hands a backbone to
the optimizer when it unfreezes it: weights and biases together, with one lr.
``split_added_group`` routes those tensors and returns one param group per route:

- **Routes.** A ``Router`` says where each tensor goes. Without one (a ``Muon`` built by
  hand) it is the flat rule of ``param_groups.flat_groups``: two or more dims to Muon, the
  rest to AdamW. ``configure_muon_optimizers`` attaches a ``ModuleRouter``: the config's
  routing rules over the module, the rules the optimizer's first groups came from
  (embeddings and head to the scalar algorithm, biases and norms to it without weight
  decay, user rules first), and the flat rule with the config's scalar algorithm for a
  tensor that is not the module's.
- **lr.** Every part keeps the relation between the optimizer's per-algorithm lrs. With
  ``B_k`` the lr a group of part ``k``'s route starts from (a rule's ``lr`` option, else the
  optimizer's lr for its algorithm, its settings' ``lr``) and ``B_0`` the one the
  optimizer's first group started from (its ``initial_lr`` once a scheduler has recorded
  it, else its ``lr``; the Muon lr while there is no group yet), a split group given lr
  ``x`` gives part ``k`` the lr ``x * B_k / B_0``: ``x`` is read on the first group's scale,
  which is how ``BackboneFinetuning`` computes it (``param_groups[0]["lr"]`` times a
  ratio). So the backbone's Muon part gets the same fraction of the Muon lr as its AdamW
  part gets of the AdamW lr. Without an lr, part ``k`` starts at ``B_k``.
- **Order.** Parts of the first group's algorithm come last. ``BackboneFinetuning`` moves
  only ``param_groups[-1]`` in later epochs, by its ramp and up to ``param_groups[0]``'s
  lr: that group is then one whose lr is on the scale it reads. The other parts keep
  their lr.
- **Names and options.** Parts are named ``"<name>.<route>"`` after the given group's
  ``name``, or ``"pg<i>.<route>"`` after the index the first part takes (LearningRateMonitor
  needs names unique within the optimizer). A route's own options (a rule's
  ``weight_decay``, ``transposed``, ...) apply, and the given group's keys override them:
  a hyperparameter goes to the parts whose algorithm has it, and one that no part's
  algorithm has is an error; any other key goes to every part.

A group whose tensors all take one route needs no split: it is added as given (its lr is
that algorithm's lr), under its own name or none, with the route's algorithm and options.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_muon._warn import warn_user
from lightning_muon.algorithms import algorithm_names
from lightning_muon.routing.param_groups import flat_groups, option_names, params_of_pairs

__all__ = ["ModuleRouter", "Router", "flat_router", "split_added_group"]

# ``router(params, names) -> groups``: dicts with "params", "param_names" (None where a
# name is unknown), "algorithm", "name" and options, covering ``params``.
Router = Callable[[list[Tensor], list[str | None]], list[dict[str, Any]]]

# Keys of the given group with a meaning of their own here.
_OWN_KEYS = ("params", "param_names", "name", "algorithm", "lr", "initial_lr")


def flat_router(params: list[Tensor], names: list[str | None]) -> list[dict[str, Any]]:
    """The flat rule (``param_groups.flat_groups``): two or more dims to a ``"muon"`` group, the rest to ``"adamw"``."""
    name_of = {id(p): n for p, n in zip(params, names)}
    routes = flat_groups([(None, p) for p in params])
    for route in routes:
        route["param_names"] = [name_of[id(p)] for p in route["params"]]
    return routes


class ModuleRouter:
    """Routes tensors by a module's routing rules, as ``route_parameters`` does at configure time.

    The rules run over the module when a group is added, so parameters unfrozen since
    (a backbone) are routed as they would have been had they been trainable from the
    start. A tensor that is not a parameter of the module takes the flat rule, with
    ``scalar_algorithm`` for tensors of fewer than two dims. The module is held by a weak
    reference: the optimizer does not keep it alive.

    Args:
        module: the model whose parameters the optimizer steps.
        routing: the ``RoutingSettings`` the optimizer's groups were routed by.
        matrix_algorithm, scalar_algorithm: the default rules' two algorithms, as they were.
    """

    def __init__(self, module: nn.Module, routing: Any, matrix_algorithm: str, scalar_algorithm: str) -> None:
        self._module = weakref.ref(module)
        self.routing = routing
        self.matrix_algorithm, self.scalar_algorithm = matrix_algorithm, scalar_algorithm

    def __call__(self, params: list[Tensor], names: list[str | None]) -> list[dict[str, Any]]:
        module = self._module()
        if module is None:
            routed = []
        else:
            routed = self.routing.route(module, self.matrix_algorithm, self.scalar_algorithm)
        where = {id(p): (g, j) for g in routed for j, p in enumerate(g["params"])}
        parts: dict[str, dict[str, Any]] = {}
        for p, given in zip(params, names):
            if id(p) in where:
                group, j = where[id(p)]
                template = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                name = group["param_names"][j]
            else:
                algorithm = self.matrix_algorithm if p.ndim >= 2 else self.scalar_algorithm
                template, name = {"algorithm": algorithm, "name": algorithm}, given
            key = template["name"]
            while key in parts and {k: v for k, v in parts[key].items() if k not in ("params", "names")} != template:
                key += "_"  # a rule's group and an unrouted tensor of the same name but other settings
            part = parts.setdefault(key, {**template, "params": [], "names": []})
            part["params"].append(p)
            part["names"].append(name)
        for part in parts.values():
            part["param_names"] = part.pop("names")
        return list(parts.values())


def split_added_group(
    param_group: dict[str, Any],
    groups: list[dict[str, Any]],
    defaults: Callable[[str], dict[str, Any]],
    router: Router | None = None,
    explain_lr: bool = False,
) -> list[dict[str, Any]]:
    """The param groups ``param_group`` (given without ``"algorithm"``) becomes; see the module docstring.

    Args:
        param_group: the group as given: ``params`` (tensors or ``(name, tensor)`` pairs,
            any iterable), and any keys.
        groups: the optimizer's param groups so far (read only).
        defaults: the optimizer's starting values of an algorithm's groups (``Muon.group_defaults``,
            with ``"lr"``).
        router: where each tensor goes; None: ``flat_router``.
        explain_lr: warn (once per process) when a split group's own lr reaches a part scaled (the groups given
            to ``Muon(...)``, where a torch user reads a group's lr as the lr of all its tensors).

    Returns:
        Groups, each with an ``"algorithm"``, for the optimizer's ``add_param_group``.

    Raises:
        ValueError: a hyperparameter that none of the parts' algorithms has; an lr to read
            on the first group's scale when that group started at lr 0.
    """
    group = dict(param_group)
    params = group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    names: list[str | None] = [None] * len(params)
    if any(isinstance(p, tuple) for p in params):
        names, params = [n for n, _ in params_of_pairs(params)], [p for _, p in params]
    names = list(group.get("param_names", names))
    where = f"param group {len(groups)}" + (f" ({group['name']!r})" if "name" in group else "")
    if not params:  # nothing to route: an empty AdamW group, as a group of no matrices
        return [{**group, "params": [], "algorithm": "adamw"}]
    routes = (router or flat_router)(params, names)
    if len(routes) == 1:
        (route,) = routes
        # Added as given (its lr is this algorithm's), with the route's algorithm and options.
        part = {k: v for k, v in route.items() if k not in ("name", "param_names")}
        part.update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        part["params"] = route["params"]
        _name_params(part, route["param_names"], group.get("name", f"pg{len(groups)}"), groups)
        return [part]

    first = groups[0]["algorithm"] if groups else None
    routes = [r for r in routes if r["algorithm"] != first] + [r for r in routes if r["algorithm"] == first]
    prefix = group.get("name", f"pg{len(groups)}")
    options = {k: v for k, v in group.items() if k not in _OWN_KEYS}
    taken: set[str] = set()
    parts = []
    for route in routes:
        own = option_names(route["algorithm"])
        part = {k: v for k, v in route.items() if k not in ("name", "params", "param_names")}
        for key, value in options.items():
            if key in own or not any(key in option_names(a) for a in algorithm_names()):
                part[key] = value
                taken.add(key)
        part["params"] = route["params"]
        part["name"] = f"{prefix}.{route['name']}"
        _name_params(part, route["param_names"], part["name"], groups)
        _scale_lrs(part, route, group, groups, defaults, where)
        parts.append(part)
    if explain_lr and "lr" in group:
        _explain_scaled_lr(group["lr"], parts, where)
    unused = sorted(set(options) - taken)
    if unused:
        split = sorted({r["algorithm"] for r in routes})
        raise ValueError(
            f"{where}: {unused} set no hyperparameter of the algorithms its tensors are routed to ({split}); "
            "give each algorithm its own group with 'algorithm'"
        )
    return parts


def _name_params(part: dict[str, Any], names: list[str | None], label: str, groups: list[dict[str, Any]]) -> None:
    """``param_names`` of ``part``, as torch wants them: every group of an optimizer named, or none.

    In an optimizer whose groups are named, an unknown name becomes ``"<label>.<j>"`` (stable
    from run to run, for the checkpoint's routing checks); in one whose groups are not, the
    part carries none; with no group yet, only complete names are kept.
    """
    if not groups:
        if all(n is not None for n in names):
            part["param_names"] = list(names)
    elif "param_names" in groups[0]:
        part["param_names"] = [f"{label}.{j}" if n is None else n for j, n in enumerate(names)]


_explained_lr = False


def _explain_scaled_lr(given: Any, parts: list[dict[str, Any]], where: str) -> None:
    """Warn once per process that a split group's lr did not reach every part as given (module docstring)."""
    global _explained_lr
    scaled = [p for p in parts if p.get("lr") != given]
    if _explained_lr or not scaled:
        return
    _explained_lr = True
    steps = ", ".join(f"its {p['algorithm']} part ({p['name']}) at lr {p['lr']:.6g}" for p in scaled)
    warn_user(  # at the Muon(...) call
        f"{where}: its lr {given!r} mixes algorithms, and is read on the scale of the first param group (Muon's lr "
        f"while there is none): {steps}, so that each part keeps the ratio of the optimizer's lrs. To set a part's "
        "lr yourself, give its tensors their own group with 'algorithm' and 'lr'"
    )


def _scale_lrs(
    part: dict[str, Any],
    route: dict[str, Any],
    given: dict[str, Any],
    groups: list[dict[str, Any]],
    defaults: Callable[[str], dict[str, Any]],
    where: str,
) -> None:
    """``lr`` (and ``initial_lr``) of ``part``: ``x * B_k / B_0`` for a given ``x``, else the route's start ``B_k``."""
    start = route.get("lr", defaults(route["algorithm"])["lr"])  # B_k
    if "lr" in route:
        part["lr"] = start
    if "lr" not in given:
        return
    first = groups[0].get("initial_lr", groups[0]["lr"]) if groups else defaults("muon")["lr"]  # B_0
    if first == 0:
        raise ValueError(
            f"{where}: its lr {given['lr']!r} is read on the scale of the first param group, which started at "
            "lr 0; give each algorithm its own group with 'algorithm' and 'lr'"
        )
    for key in ("lr", "initial_lr"):
        if key in given:
            part[key] = given[key] * start / first
