"""The parameter groups a config's optimizer needs before the flat shards are made: Muon's two halves and muP's
width groups. Both depend on each parameter's shape, which the flat shards no longer carry.

[Note: muP on flat shards]
muP's optimizers (the `mup` package's `MuAdam`, `MuAdamW` and `MuSGD`; ds_config "MuAdam", "MuAdamW", "MuSGD")
scale each parameter's lr and weight decay by its width multiplier, read from the `infshape` that
`mup.set_base_shapes(model, base)` attaches to every parameter. The update itself is torch's Adam, AdamW or SGD,
elementwise; only the group a parameter steps in depends on its shape. So each user group is split here, while the
parameters are whole, by mup's rules (mup 1.0.0 `optim.py`, which DeepSpeed 0.19.8 calls over the same groups in
`_configure_basic_optimizer`), and each part becomes its own flat shard with its scaled options:
- Adam-like (MuAdam, MuAdamW): a matrix-like parameter (two infinite dimensions) goes to the group of its
  `width_mult()`, lr / w and weight_decay * w; the rest (vectors, scalars) to one group, unscaled.
- MuSGD: matrix-like by `fanin_fanout_mult_ratio()` r (lr / r, weight_decay * r); vector-like (one infinite
  dimension) by `width_mult()` w (lr * w, weight_decay / w); finite ones unscaled.
Groups come in mup's order (matrix-like, then vector-like, then finite; within a kind in order of first
appearance); a group's missing lr is `optimizer.params.lr` and its missing weight_decay `optimizer.params.
weight_decay` or 0, as mup fills them. Groups left empty are dropped (mup passes them to torch; they hold nothing).
The `mup` package itself is not needed: only the `infshape` objects its `set_base_shapes` leaves. Tested in
`tests/unit/test_regroup.py` and `tests/distributed/test_mup.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.optim import muon
from zeroshard.zero.strategy import ParamGroupSpec

if TYPE_CHECKING:
    from zeroshard.config import ZeroshardConfig

# ds_config names (lower case) of muP's optimizers, and the torch class each steps with (mup's `impl`).
MUP_OPTIMIZERS: Mapping[str, str] = {"muadam": "Adam", "muadamw": "AdamW", "musgd": "SGD"}
_KIND_ORDER = ("matrix", "vector", "finite")


def config_groups(
    cfg: ZeroshardConfig, groups: list[ParamGroupSpec], model: nn.Module, split: bool
) -> list[ParamGroupSpec]:
    """The groups the config's optimizer steps: Muon's halves, muP's width groups, or `groups` unchanged.
    `split`: the parameters are cut by a pipeline or tensor parallelism (Muon needs whole matrices)."""
    if cfg.optimizer is None:
        return groups
    kind = str(cfg.optimizer.type).lower()
    params = cfg.optimizer.params or {}  # checked when the config was resolved (probe_optimizer)
    if kind == "muon":
        return _muon_halves(cfg, params, groups, model, split)
    if kind in MUP_OPTIMIZERS:
        return mup_groups(str(cfg.optimizer.type), params, groups)
    return groups


def mup_groups(type_name: str, params: Mapping[str, Any], groups: list[ParamGroupSpec]) -> list[ParamGroupSpec]:
    """Each group split by width, its lr and weight decay scaled: [Note: muP on flat shards].

    Example:
        >>> import torch
        >>> class Shape:  # what mup.set_base_shapes attaches: two infinite dimensions, 4x the base width
        ...     def ninf(self): return 2
        ...     def width_mult(self): return 4.0
        >>> w, b = torch.nn.Parameter(torch.zeros(8, 8)), torch.nn.Parameter(torch.zeros(8))
        >>> w.infshape, b.infshape = Shape(), type("Vec", (), {"ninf": lambda self: 1})()
        >>> split = mup_groups("MuAdamW", {"lr": 0.01, "weight_decay": 0.1}, [ParamGroupSpec({}, [("w", w), ("b", b)])])
        >>> [(g.options, [n for n, _ in g.params]) for g in split]
        [({'lr': 0.0025, 'weight_decay': 0.4}, ['w']), ({'lr': 0.01, 'weight_decay': 0.1}, ['b'])]
    """
    sgd = type_name.lower() == "musgd"
    out: list[ParamGroupSpec] = []
    for index, group in enumerate(groups):
        options = dict(group.options)
        if "lr" not in options:
            if "lr" not in params:
                raise ConfigError(
                    f"optimizer.params.lr is missing: {type_name} scales each parameter group's lr by its width "
                    f"and parameter group {index} has no lr of its own; set optimizer.params.lr"
                )
            options["lr"] = params["lr"]
        options.setdefault("weight_decay", params.get("weight_decay", 0.0))
        parts: dict[tuple[str, float], list[tuple[str, nn.Parameter]]] = {}
        for name, param in group.params:
            parts.setdefault(_width_class(type_name, name, param, sgd), []).append((name, param))
        for kind in _KIND_ORDER:
            for (part_kind, mult), named in parts.items():
                if part_kind == kind:
                    out.append(ParamGroupSpec(_scaled(options, kind, mult, sgd), named))
    return out


def _width_class(type_name: str, name: str, param: nn.Parameter, sgd: bool) -> tuple[str, float]:
    """(kind, multiplier) of one parameter by mup's rules; ConfigError without an `infshape`."""
    shape = getattr(param, "infshape", None)
    if shape is None:
        raise ConfigError(
            f"parameter {name} (shape {tuple(param.shape)}) has no `infshape`: optimizer.type {type_name!r} scales "
            "each parameter by its width; call mup.set_base_shapes(model, base_shapes) before initialize"
        )
    infinite = int(shape.ninf())
    if infinite > 2:
        raise ConfigError(
            f"parameter {name} has {infinite} infinite dimensions; {type_name} (mup) handles at most 2 "
            "(mup raises NotImplementedError too)"
        )
    if infinite == 2:
        return "matrix", float(shape.fanin_fanout_mult_ratio() if sgd else shape.width_mult())
    if infinite == 1 and sgd:
        return "vector", float(shape.width_mult())
    return ("finite", 1.0) if sgd else ("vector", 1.0)


def _scaled(options: dict[str, Any], kind: str, mult: float, sgd: bool) -> dict[str, Any]:
    """A group's options for one width class, with mup's arithmetic (lr / w and decay * w, or the inverse)."""
    scaled = dict(options)
    if kind == "matrix":
        scaled["lr"] /= mult
        scaled["weight_decay"] *= mult
    elif kind == "vector" and sgd:
        scaled["lr"] *= mult
        scaled["weight_decay"] /= mult
    return scaled


def _muon_halves(
    cfg: ZeroshardConfig,
    params: Mapping[str, Any],
    groups: list[ParamGroupSpec],
    model: nn.Module,
    split: bool,
) -> list[ParamGroupSpec]:
    """Each group as its Muon and Adam halves ([Note: Muon on flat shards] in optim/muon.py)."""
    from zeroshard.moe.zero import moe_layers

    if split or moe_layers(model) or int(cfg.sequence_parallel_size or 1) > 1:  # (a sequence mpu sets the size)
        raise ConfigError(
            'optimizer.type "Muon" does not work with a PipelineModule, tensor, sequence parallelism or MoE layers '
            "yet; use AdamW"
        )
    halves = []
    for group in groups:
        for use in (True, False):
            named = [(name, p) for name, p in group.params if muon.uses_muon(name, p.shape) is use]
            if named:
                halves.append(ParamGroupSpec(muon.half_options(params, group.options, use), named))
    return halves
