"""Trainable parameters outside the optimizer that fp32 stage 0 still reduces and clips over.

[Note: clipping over the whole module at stage 0]
DeepSpeed's fp32 stage 0 (no ZeRO optimizer) all-reduces the gradient of every module parameter that requires
one, clips over `module.parameters()` and clears every module `.grad` at the step, so a parameter the user left
out of the optimizer (bing_bert leaves out the pooler) still counts in the clipping norm. Stages 1-3 and the
fp16/bf16 optimizers clip over the optimizer's parameters only. At fp32 stage 0 we do the same with those
"bystanders": their gradients are reduced like the others (summed after the prescale), their norms join the
global norm, and the step clears them. Without it bing_bert's losses moved 2e-6 relative from DeepSpeed's.
A split strategy's parts share one module: only its first part keeps the bystanders (`flat_parts`), or each
part would reduce them again and count them once more in the norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zeroshard.comm.collectives import Collectives
from zeroshard.zero.flat.local import local_of
from zeroshard.zero.stepmath import tensor_norms

PIPE_REPLICATED = "ds_pipe_replicated"  # [Note: tied copies in the norm] in pipe/context.py


def find_bystanders(module: nn.Module, owned: set[int]) -> list[nn.Parameter]:
    """The module's trainable parameters not in `owned` (ids), except a pipeline's tied copies (counted once
    elsewhere)."""
    return [
        p
        for p in module.parameters()
        if p.requires_grad and id(p) not in owned and not getattr(p, PIPE_REPLICATED, False)
    ]


class Bystanders:
    """The bystanders of one strategy: reduced over `comm` before the step, in the norm, cleared after it."""

    def __init__(self, params: list[nn.Parameter], comm: Collectives, prescale: Callable[[int], float]):
        self.params = params
        self.comm = comm
        self.prescale = prescale

    def reduce(self) -> None:
        """Sum the gradients over ranks (a missing one counts as zero, as DeepSpeed's all-reduce makes it),
        prescaled as the tracked ones are; a DTensor's local shard ([Note: DTensor parameters])."""
        if not self.params:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
                # a Partial gradient summed first ([Note: replicated with grad all-reduce] in tp/plan.py)
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local_of(p.grad) for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        prescale = self.prescale(self.comm.world_size)
        if prescale != 1.0:
            flat.mul_(prescale)
        self.comm.all_reduce(flat, label="stage0.bystander_grads")
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view(grad.shape))

    def norms(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(bystander, the norm of this rank's part of its reduced gradient), for those with a gradient."""
        held = [(p, local_of(p.grad)) for p in self.params if p.grad is not None]
        held = [(p, g) for p, g in held if g.numel() > 0]  # tensor_norms leaves empty ones out (a rank's DTensor part)
        return list(zip([p for p, _ in held], tensor_norms([g for _, g in held]), strict=True))

    def clear(self) -> None:
        for param in self.params:
            param.grad = None
