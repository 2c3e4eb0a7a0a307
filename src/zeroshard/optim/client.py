"""A client optimizer (an instance, or what a callable built) on the flat shards of the zero backend.

[Note: client optimizers on flat shards]
The zero backend hands the optimizer flat tensors that each hold pieces of many parameters ([Note: elementwise
optimizers only] in optimizers.py). A config's optimizer is checked by name; a client's was taken as it came, so
transformers' Adafactor (HF Trainer's `optim="adafactor"`) ran unfactored, its update clipped by the RMS of a whole
shard instead of each parameter's: another algorithm, silently. DeepSpeed refuses every client optimizer outside its
short list unless `zero_allow_untested_optimizer` is true (torch's SGD included). Here a client optimizer is
- taken when it is one known to update each element from its own gradient and state alone: torch's elementwise
  optimizers, zeroshard's, DeepSpeed's fused and CPU Adam/Adagrad/Lion, apex's FusedAdam/FusedSGD;
- refused, whatever the key says, when it is one known to look at whole tensors (Adafactor, Shampoo, GaLore, ...),
  naming the fsdp2 backend, whose shards keep each parameter's shape;
- otherwise taken only with `zero_allow_untested_optimizer: true` (with a warning), as DeepSpeed asks.
The fsdp2 backend's optimizers step per-parameter DTensors, so any optimizer is valid there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.optimizers import _NOT_ELEMENTWISE, _TORCH_ELEMENTWISE
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

_ELEMENTWISE_ELSEWHERE = frozenset(
    {
        ("deepspeed.ops.adam.fused_adam", "FusedAdam"),
        ("deepspeed.ops.adam.cpu_adam", "DeepSpeedCPUAdam"),
        ("deepspeed.ops.adam.zenflow_cpu_adam", "ZenFlowCPUAdam"),
        ("deepspeed.ops.adagrad.cpu_adagrad", "DeepSpeedCPUAdagrad"),
        ("deepspeed.ops.lion.cpu_lion", "DeepSpeedCPULion"),
        ("deepspeed.ops.lion.fused_lion", "FusedLion"),
        ("apex.optimizers.fused_adam", "FusedAdam"),
        ("apex.optimizers.fused_sgd", "FusedSGD"),
    }
)
# whole-tensor updates (lower-case class names, prefixes where a family shares one) beyond the config names refused
_WHOLE_TENSOR = {
    **_NOT_ELEMENTWISE,
    "adafactor": "Adafactor factors the second moment over each matrix's rows and columns and clips each update by "
    "its tensor's RMS",
    "shampoo": "Shampoo preconditions each matrix by its row and column statistics",
    "distributedshampoo": "Shampoo preconditions each matrix by its row and column statistics",
    "soap": "SOAP preconditions each matrix in its eigenbasis",
    "galore": "GaLore projects each matrix's gradient onto a low-rank subspace",
    "adammini": "Adam-mini shares one second moment per parameter block",
    "adam_mini": "Adam-mini shares one second moment per parameter block",
    "prodigy": "Prodigy estimates its step size from dot products over the whole parameters",
    "dadapt": "D-Adaptation estimates its step size from dot products over the whole parameters",
    "lomo": "LOMO updates fused into each parameter's backward",
    "adalomo": "AdaLomo factors the second moment over each matrix's rows and columns",
    "apollo": "APOLLO scales each matrix's update by channel-wise statistics of a projection",
    "muon": "Muon orthogonalises each matrix's update (the config's Muon makes each matrix whole for it)",
    "lamb": "LAMB scales each parameter's update by its trust ratio (the config's Lamb gets each parameter's norms)",
    "fusedlamb": "LAMB scales each parameter's update by its trust ratio (the config's Lamb gets each parameter's "
    "norms)",
    "lars": "LARS scales each parameter's update by its trust ratio",
    "novograd": "NovoGrad keeps one second moment per layer",
    "came": "CAME factors its statistics over each matrix's rows and columns",
    "stableadamw": "StableAdamW clips each update by its tensor's RMS",
}


def check_client_optimizer(optimizer: torch.optim.Optimizer | type, cfg: Any, warn: bool = True) -> None:
    """Refuse, in one line, a client optimizer (an instance, or the class a callable builds) the zero backend's flat
    shards would change ([Note: client optimizers on flat shards]); `cfg`: the engine's ZeroshardConfig."""
    if str(cfg.zeroshard.backend) == "fsdp2":
        return
    stage, allow_untested = int(cfg.zero_optimization.stage), bool(cfg.zero_allow_untested_optimizer)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__
    if _known_elementwise(cls):
        return
    reason = _whole_tensor_reason(name)
    if reason is not None:
        raise ConfigError(
            f"optimizer {cls.__module__}.{name}: {reason}, but zero_optimization.stage {stage} hands the optimizer "
            "flat shards of many parameters, where it would compute something else; use an elementwise optimizer "
            '(AdamW, SGD, Lion, ...), Muon or Lamb from the config, or "zeroshard": {"backend": "fsdp2"} (stages '
            "2-3), whose shards keep each parameter's shape"
        )
    if not allow_untested:
        raise ConfigError(
            f"optimizer {cls.__module__}.{name} is not one zeroshard knows to update each element from its own "
            f"gradient and state alone, which zero_optimization.stage {stage}'s flat shards of many parameters need: "
            'if it does, set "zero_allow_untested_optimizer": true (DeepSpeed asks the same); otherwise use '
            '"zeroshard": {"backend": "fsdp2"} (stages 2-3), whose shards keep each parameter\'s shape'
        )
    if not warn:
        return
    log_rank(
        logger,
        30,
        f"optimizer {name} on flat shards of many parameters (zero_allow_untested_optimizer): right only if its "
        "update of each element depends on that element's gradient and state alone",
    )


def class_built_by(optimizer: Any) -> type | None:
    """The optimizer class a client callable builds, for the check before the model is sharded: the class itself,
    a `functools.partial` of it, or the class of what another callable (a lambda) builds over one throwaway
    parameter, as the config's optimizer is probed. A callable that cannot build over it is checked once it has
    built over the engine's groups (where its own error, if any, is raised)."""
    func = optimizer.func if isinstance(optimizer, functools.partial) else optimizer
    if isinstance(func, type) and issubclass(func, torch.optim.Optimizer):
        return func
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        return None
    try:
        built = optimizer([{"params": [torch.zeros(1, requires_grad=True)]}])
    except Exception:  # noqa: BLE001 - see the docstring: the real call comes later
        return None
    return type(built) if isinstance(built, torch.optim.Optimizer) else None


def _known_elementwise(cls: type) -> bool:
    if cls.__module__.startswith("torch.optim"):
        return cls.__name__ in _TORCH_ELEMENTWISE
    if cls.__module__.startswith("zeroshard."):  # its own: Lamb and Muon are planned by the strategy
        return True
    return any(cls.__module__ == module and cls.__name__ == name for module, name in _ELEMENTWISE_ELSEWHERE)


def _whole_tensor_reason(name: str) -> str | None:
    key = name.lower()
    for prefix, reason in _WHOLE_TENSOR.items():  # (MuonWithAuxAdam, GaLoreAdamW8bit, DAdaptAdam, ...)
        if key.startswith(prefix):
            return reason
    return None
