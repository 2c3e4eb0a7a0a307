"""muP for the tests ([Note: muP on flat shards] in optim/regroup.py): the `infshape` that `mup.set_base_shapes`
attaches, re-created (the mup package needs torchvision, which would replace the test machine's torch), and the
single-process reference's optimizer: one group per parameter, its lr and weight decay scaled by mup's formulas."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from helpers.parity import TINY, Case, build_model, param_groups
from zeroshard.models.gpt import GPT

# the base model of set_base_shapes: the tiny GPT at a quarter of its width (TINY.n_embd 32)
BASE = replace(TINY, n_embd=8)


class InfShape(tuple):
    """mup 1.0.0's InfShape, what its optimizers read: (base, dim) per dimension, base None where finite."""

    def ninf(self) -> int:
        return sum(1 for base, _ in self if base is not None)

    def width_mult(self) -> float:
        infinite = [dim / base for base, dim in self if base is not None]
        return infinite[-1] if infinite else 1  # the last infinite dimension (a matrix's fan-in)

    def fanin_fanout_mult_ratio(self) -> float:
        (fanout_base, fanout), (fanin_base, fanin) = self[0], self[1]
        fanin_mult = fanin / fanin_base if fanin_base is not None else 1
        return fanin_mult / (fanout / fanout_base if fanout_base is not None else 1)


def attach_infshapes(model: nn.Module) -> nn.Module:
    """What `mup.set_base_shapes(model, GPT(BASE))` does to the shapes: a dimension is infinite where it differs."""
    base = dict(GPT(BASE).named_parameters())
    for name, param in model.named_parameters():
        dims = zip(base[name].shape, param.shape, strict=True)
        param.infshape = InfShape((b if b != d else None, d) for b, d in dims)  # type: ignore[attr-defined]
    return model


def build_mup_model(case: Case) -> nn.Module:
    """The parity GPT with `infshape`s, read in the forward as mup's `MuReadout` reads its weight's (a block's norm
    and the root's: the fsdp2 backend's units replace the parameters, [Note: parameter attributes under fsdp2])."""
    model = attach_infshapes(build_model(case))
    for module in (model.blocks[0].ln_1, model.ln_f):
        module.register_forward_pre_hook(_reads_infshape)
    return model


def _reads_infshape(module: nn.Module, args: object) -> None:
    module.weight.infshape.width_mult()


def with_optimizer(type_name: str, config: dict, backend: str = "zero") -> dict:
    """The parity config with `optimizer.type` set to a muP optimizer (its lr and weight_decay kept)."""
    config["optimizer"]["type"] = type_name
    config["zeroshard"] = {**config.get("zeroshard", {}), "backend": backend}
    return config


def reference_optimizer(type_name: str, model: nn.Module, case: Case) -> torch.optim.Optimizer:
    """torch's optimizer with one group per parameter, lr and weight decay by mup's formulas (not its grouping)."""
    attach_infshapes(model)
    sgd = type_name == "MuSGD"
    groups = []
    for group in param_groups(model, case):
        for param in group["params"]:
            shape, lr, decay = param.infshape, case.lr, group["weight_decay"]
            if shape.ninf() == 2:
                mult = shape.fanin_fanout_mult_ratio() if sgd else shape.width_mult()
                lr, decay = lr / mult, decay * mult
            elif shape.ninf() == 1 and sgd:
                lr, decay = lr * shape.width_mult(), decay / shape.width_mult()
            groups.append({"params": [param], "lr": lr, "weight_decay": decay})
    cls = {"MuAdam": torch.optim.Adam, "MuAdamW": torch.optim.AdamW, "MuSGD": torch.optim.SGD}[type_name]
    return cls(groups, lr=case.lr)
