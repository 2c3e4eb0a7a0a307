"""Build the optimizer named by ds_config `optimizer.type` / `optimizer.params`.

[Note: elementwise optimizers only] The ZeRO engine hands the optimizer ONE flat fp32 tensor per parameter
group, a shard that concatenates slices of many parameters. An optimizer whose update of one element depends
only on that element's own gradient and state (Adam, SGD, Lion, ...) gives the same result on the shard as on
the original parameters. Anything that looks at a whole tensor (LAMB's trust ratio, Muon's orthogonalisation,
Adafactor's row/column factors, 1-bit compression, LBFGS's line search) would silently compute something else,
so those names are refused. Muon and LAMB are built anyway: the strategies make each of Muon's matrices whole for
the step ([Note: Muon on flat shards] in muon.py) and give LAMB each parameter's whole norms ([Note: LAMB on flat
shards] in lamb.py). muP's optimizers are torch's Adam, AdamW and SGD over groups split by width before the shards
are made ([Note: muP on flat shards] in regroup.py).

[Note: Adam implementation] DeepSpeed maps "Adam"/"AdamW" to its FusedAdam (weight_decay default 0.0,
decoupled unless `adam_w_mode: false` on "Adam"). We use torch's Adam/AdamW (or, for `bias_correction: false`,
which torch's lack, `optim.adam.UncorrectedAdam`) with the same defaults and
`fused=True` when every tensor is on a device with fused kernels, else `foreach=True`. One step of AdamW
(weight_decay=0.01) on a single 10M-element fp32 tensor, torch 2.13 CPU, 2 threads (best of 3 x 20 steps):

    default (for-loop): 44.6 ms    foreach: 31.6 ms    fused: 5.0 ms
    (Adam with L2 decay: 50.8 / 38.3 / 5.1 ms)
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from zeroshard.config.fields import Bool, Check, Float, Nullable, show
from zeroshard.errors import ConfigError
from zeroshard.optim import muon
from zeroshard.optim.adam import UncorrectedAdam
from zeroshard.optim.lamb import Lamb
from zeroshard.optim.lion import Lion
from zeroshard.optim.regroup import MUP_OPTIMIZERS

# torch.optim classes whose update is elementwise, by their exact names.
_TORCH_ELEMENTWISE: tuple[str, ...] = (
    "ASGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
)

# Names (lower case) refused by [Note: elementwise optimizers only], with the reason shown to the user.
_NOT_ELEMENTWISE: Mapping[str, str] = MappingProxyType(
    {
        "onebitadam": "1-bit Adam compresses whole-tensor communication and needs DeepSpeed's backend",
        "zerooneadam": "0/1 Adam compresses whole-tensor communication and needs DeepSpeed's backend",
        "onebitlamb": "1-bit LAMB uses per-tensor trust ratios and compressed communication",
        "adafactor": "Adafactor factors the second moment over each matrix's rows and columns",
        "lbfgs": "LBFGS needs a closure and a line search over all parameters",
        "sparseadam": "SparseAdam needs sparse gradients",
    }
)

# DeepSpeed-only Adam keys that torch's Adam/AdamW lack; consumed in _adam_kwargs.
_DS_ADAM_KEYS = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none", "fp32_optimizer_states")
# DeepSpeed-only keys other optimizers accept and ignore (values that match zeroshard's behaviour; with bf16/fp16
# master weights fp32_optimizer_states false is read by precision/policy.py: [Note: bf16 master weights]).
_DS_IGNORED_KEYS = ("set_grad_none", "fp32_optimizer_states")
# FusedAdam's defaults where they differ from torch's (torch AdamW defaults weight_decay to 0.01).
_FUSED_ADAM_DEFAULTS: Mapping[str, Any] = MappingProxyType({"weight_decay": 0.0})
# Keys whose JSON list value torch wants as a tuple of floats.
_TUPLE_KEYS = ("betas", "etas", "step_sizes")
# Ranges of the keys torch optimizers share; other keys are checked by the type of their default.
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening")


def supported_optimizer_names() -> list[str]:
    """The `optimizer.type` values build_optimizer accepts (matched case-insensitively)."""
    return sorted({*_TORCH_ELEMENTWISE, "Lamb", "Lion", "Muon", "MuAdam", "MuAdamW", "MuSGD"}, key=str.lower)


def build_optimizer(
    type_name: str, params: Mapping[str, Any], param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Build ds_config `optimizer.type` with `optimizer.params` over torch-style `param_groups`.

    Names are case-insensitive. "Adam" means AdamW (decoupled weight decay) unless `adam_w_mode` is false,
    as in DeepSpeed; DeepSpeed-only keys (adam_w_mode, torch_adam, bias_correction, ...) are consumed here.

    Example:
        >>> import torch
        >>> w = torch.zeros(10, requires_grad=True)
        >>> opt = build_optimizer("Adam", {"lr": 1e-3, "weight_decay": 0.1}, [{"params": [w]}])
        >>> type(opt).__name__, opt.defaults["weight_decay"]
        ('AdamW', 0.1)
    """
    kwargs = dict(params or {})
    if "max_grad_norm" in kwargs:
        raise ConfigError(
            "optimizer.params.max_grad_norm is not an optimizer parameter; set the top-level "
            '"gradient_clipping" key instead.'
        )
    key = type_name.lower()
    if key == "muon":  # whole-matrix steps on flat shards: [Note: Muon on flat shards]
        return _build_muon(kwargs, param_groups)
    # the DeepSpeed class this optimizer stands for, which isinstance tests ([Note: DeepSpeed's optimizer classes])
    ds_class = {"adam": "FusedAdam", "adamw": "FusedAdam", "lamb": "FusedLamb", "lion": "FusedLion"}.get(key)
    ds_class = None if ds_class == "FusedAdam" and _bool_param(kwargs, "torch_adam", False) else ds_class
    if key in ("adam", "adamw"):
        cls, kwargs = _adam_kwargs(key, kwargs, param_groups)
    elif key in MUP_OPTIMIZERS:  # torch's class over groups split by width ([Note: muP on flat shards]), as mup
        cls = getattr(torch.optim, MUP_OPTIMIZERS[key])  # builds it: the keys as given, DeepSpeed's ones refused
        if cls is not torch.optim.SGD and "fused" not in kwargs and "foreach" not in kwargs:
            kwargs["fused" if _fused_kernels_available(param_groups) else "foreach"] = True
    else:
        cls = _resolve_class(type_name)
        kwargs = _drop_ds_only_keys(cls, kwargs)
    _check_keys(cls, kwargs)
    _check_values(cls, kwargs)
    _tuples(kwargs)
    try:
        optimizer = cls(param_groups, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optimizer.params is invalid for optimizer.type={type_name!r}: {err}") from err
    if ds_class is not None:
        setattr(optimizer, DEEPSPEED_CLASS, ds_class)
    return optimizer


DEEPSPEED_CLASS = "_deepspeed_class"


def as_deepspeed_builds(optimizer: torch.optim.Optimizer, cfg: Any) -> torch.optim.Optimizer:
    """[Note: DeepSpeed's optimizer classes]
    `deepspeed.ops.adam.FusedAdam` and its relatives are classes in DeepSpeed, and scripts test
    `isinstance(opt, FusedAdam)`; here they build torch's optimizers (ops/adam.py). Each optimizer built under one
    of those names, by it or from a ds_config DeepSpeed would build it for, carries the name (`DEEPSPEED_CLASS`),
    which the names' `isinstance` reads (`ops._params.DeepSpeedOptimizerClass`): a config's Adam/AdamW is
    FusedAdam (torch's with `torch_adam`), DeepSpeedCPUAdam where the optimizer is offloaded, as DeepSpeed picks;
    a config's Lamb is FusedLamb, its Lion FusedLion (DeepSpeedCPULion offloaded), its Adagrad torch's
    (DeepSpeedCPUAdagrad offloaded). This marks the offloaded case, which the config's optimizer block does not know."""
    offloaded = str(cfg.zero_optimization.offload_optimizer.device) != "none"
    if offloaded:
        marked = getattr(optimizer, DEEPSPEED_CLASS, None)
        if isinstance(marked, str) and marked in _OFFLOADED_CLASS:
            setattr(optimizer, DEEPSPEED_CLASS, _OFFLOADED_CLASS[marked])
        elif marked is None and type(optimizer) is torch.optim.Adagrad:
            setattr(optimizer, DEEPSPEED_CLASS, "DeepSpeedCPUAdagrad")
    return optimizer


# what DeepSpeed builds instead of a config's optimizer when ZeRO offloads it to the CPU
_OFFLOADED_CLASS = MappingProxyType({"FusedAdam": "DeepSpeedCPUAdam", "FusedLion": "DeepSpeedCPULion"})


def probe_optimizer(type_name: str, params: Mapping[str, Any]) -> torch.optim.Optimizer:
    """`build_optimizer` over one throwaway parameter: raises what building it for a model would raise (the
    ConfigError naming `optimizer.type` or `optimizer.params.<key>`), before any model exists.

    Example:
        >>> probe_optimizer("AdamW", {"lr": "fast"})
        Traceback (most recent call last):
        ...
        zeroshard.errors.ConfigError: optimizer.params.lr: "fast" is not a number
    """
    probe = torch.zeros(1, requires_grad=True)
    return build_optimizer(type_name, params, [{"params": [probe]}])


def optimizer_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The lr, betas, eps and weight_decay a client optimizer was built with (those it has), as Python values.

    Used to resolve ds_config "auto" values from an optimizer the user constructed.

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=3e-4)
        >>> optimizer_defaults(opt)
        {'lr': 0.0003, 'betas': (0.9, 0.999), 'eps': 1e-08, 'weight_decay': 0.01}
    """
    source = dict(optimizer.param_groups[0]) if optimizer.param_groups else {}
    source.update(optimizer.defaults)
    found: dict[str, Any] = {}
    for name in ("lr", "betas", "eps", "weight_decay"):
        if name in source:
            found[name] = _as_python(source[name])
    return found


def _as_python(value: Any) -> Any:
    """A tensor or tuple of tensors as Python floats; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple | list):
        return tuple(_as_python(v) for v in value)
    return value


def _resolve_class(type_name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class for a (non-Adam) name, or a ConfigError explaining why there is none."""
    key = type_name.lower()
    supported = supported_optimizer_names()
    if key in _NOT_ELEMENTWISE:
        raise ConfigError(
            f"optimizer.type={type_name!r} is not supported: {_NOT_ELEMENTWISE[key]}, but ZeRO hands the "
            f"optimizer flat shards of many parameters, so only elementwise optimizers are valid. "
            f"Supported: {', '.join(supported)}."
        )
    if key == "lion":
        return Lion
    if key == "lamb":  # per-parameter trust ratios on flat shards: [Note: LAMB on flat shards]
        return Lamb
    for name in _TORCH_ELEMENTWISE:
        if name.lower() == key:
            cls: type[torch.optim.Optimizer] = getattr(torch.optim, name)
            return cls
    lowered = {name.lower(): name for name in supported}
    close = difflib.get_close_matches(key, list(lowered), n=1)
    hint = f" Did you mean {lowered[close[0]]!r}?" if close else ""
    raise ConfigError(f"optimizer.type={type_name!r} is unknown.{hint} Supported: {', '.join(supported)}.")


def _adam_kwargs(
    key: str, kwargs: dict[str, Any], param_groups: list[dict[str, Any]]
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Map DeepSpeed's Adam/AdamW keys onto torch's Adam/AdamW (see [Note: Adam implementation])."""
    adam_w_mode = _bool_param(kwargs, "adam_w_mode", True)
    torch_adam = _bool_param(kwargs, "torch_adam", False)
    bias_correction = _bool_param(kwargs, "bias_correction", True)
    if torch_adam and not bias_correction:
        raise ConfigError(
            "optimizer.params.bias_correction=false needs DeepSpeed's Adam, but optimizer.params.torch_adam=true "
            "selects torch's, which always corrects (DeepSpeed passes the key to torch, which refuses it)"
        )
    for name in _DS_ADAM_KEYS:
        kwargs.pop(name, None)
    decoupled = key == "adamw" or adam_w_mode
    if not torch_adam:
        # DeepSpeed's default path is FusedAdam, whose defaults we keep; torch_adam selects torch's own.
        for name, value in _FUSED_ADAM_DEFAULTS.items():
            kwargs.setdefault(name, value)
    if not bias_correction:  # FusedAdam / DeepSpeedCPUAdam's flag: optim/adam.py
        if _bool_param(kwargs, "amsgrad", False):
            raise ConfigError("optimizer.params.amsgrad=true does not work with bias_correction=false (no AMSGrad)")
        kwargs.pop("amsgrad", None)
        return UncorrectedAdam, {**kwargs, "adam_w_mode": decoupled}
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if "fused" not in kwargs and "foreach" not in kwargs:
        if _fused_kernels_available(param_groups):
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
    return cls, kwargs


def _build_muon(kwargs: dict[str, Any], param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Muon over the groups initialize split in halves (`use_muon`); a group without the mark (the probe's) is Adam."""
    muon.check_params(kwargs)
    groups = []
    for group in param_groups:
        marked = dict(group)
        if "use_muon" not in marked:
            marked.update(muon.half_options(kwargs, {}, muon=False))
        groups.append(_tuples(marked))
    try:
        return muon.Muon(groups, adam_w_mode=kwargs.get("adam_w_mode", True))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optimizer.params is invalid for optimizer.type='Muon': {err}") from err


def _tuples(options: dict[str, Any]) -> dict[str, Any]:
    """JSON lists in `_TUPLE_KEYS` as the tuples of floats torch wants (it refuses betas that mix ints and floats:
    JSON's 0 is an int)."""
    for name in _TUPLE_KEYS:
        if isinstance(options.get(name), list | tuple):
            options[name] = tuple(float(value) for value in options[name])
    return options


def _bool_param(kwargs: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean optimizer param, type-checked."""
    value = kwargs.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"optimizer.params.{name} must be true or false, got {value!r}")
    return value


def _drop_ds_only_keys(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Consume DeepSpeed-only keys the torch class lacks, when their value matches what zeroshard does."""
    accepted = _accepted_keys(cls)
    for name in _DS_IGNORED_KEYS:
        if name not in accepted:
            kwargs.pop(name, None)
    if "amsgrad" not in accepted and "amsgrad" in kwargs:
        # DeepSpeed's CPU Adagrad takes amsgrad and ignores it; only the no-op value is safe to accept.
        if kwargs["amsgrad"] is not False:
            raise ConfigError(
                f"optimizer.params.amsgrad={kwargs['amsgrad']!r} is not supported by {cls.__name__}; "
                "remove it or set it to false."
            )
        del kwargs["amsgrad"]
    return kwargs


def _accepted_keys(cls: type[torch.optim.Optimizer]) -> list[str]:
    """Keyword parameters of the optimizer's constructor, other than the parameters themselves."""
    signature = inspect.signature(cls.__init__)
    return [
        name
        for name, p in signature.parameters.items()
        if name not in ("self", "params", "model_params")
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def _check_keys(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> None:
    """ConfigError naming the first key the optimizer's constructor does not take."""
    accepted = _accepted_keys(cls)
    for name in kwargs:
        if name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"optimizer.params.{name} is not a parameter of {cls.__name__}.{hint} Accepted: {', '.join(accepted)}."
            )


def _check_values(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> None:
    """ConfigError naming the first value of the wrong type or range, judged by the constructor's default."""
    signature = inspect.signature(cls.__init__)
    for name, value in kwargs.items():
        parameter = signature.parameters[name]  # _check_keys let only constructor parameters through
        check = _value_check(name, parameter.default, parameter.annotation)
        if check is not None:
            check(value, f"optimizer.params.{name}")


def _value_check(name: str, default: object, annotation: object) -> Check | None:
    """The check of one constructor argument: a named range, else the type of its default (None: the
    constructor's own checks decide)."""
    if name == "betas":
        return _Numbers(2, below_one=True)
    if name in _NON_NEGATIVE:
        return Float(minimum=0.0)
    if isinstance(default, bool):
        return Bool()
    if isinstance(default, int | float):
        return Float()
    if isinstance(default, tuple) and all(isinstance(v, int | float) for v in default):
        return _Numbers(len(default))
    if default is None and "bool" in str(annotation):  # foreach, fused: Optional[bool]
        return Nullable(Bool())
    return None


@dataclass(frozen=True)
class _Numbers:
    """A JSON list of `count` finite numbers (betas, etas, step_sizes), each in [0, 1) with `below_one`."""

    count: int
    below_one: bool = False

    def __call__(self, value: object, path: str) -> object:
        if isinstance(value, str) or not isinstance(value, list | tuple) or len(value) != self.count:
            raise ConfigError(f"{path}: {show(value)} is not a list of {self.count} numbers")
        for index, entry in enumerate(value):
            number = Float(minimum=0.0 if self.below_one else None)(entry, f"{path}[{index}]")
            if self.below_one and number >= 1.0:
                raise ConfigError(f"{path}[{index}]: {show(entry)} is out of range; expected >= 0 and < 1")
        return value


def _fused_kernels_available(param_groups: list[dict[str, Any]]) -> bool:
    """Whether torch has fused Adam kernels for every tensor (floating point, dense, supported device)."""
    devices = _fused_devices()
    for group in param_groups:
        for tensor in group["params"]:
            if tensor.is_sparse or not tensor.is_floating_point() or tensor.device.type not in devices:
                return False
    return True


def _fused_devices() -> tuple[str, ...]:
    """Device types with fused optimizer kernels in the installed torch (its own list when it exposes one)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ("cpu", "cuda")
    return tuple(_get_fused_kernels_supported_devices())
