"""The PyTorch baselines: DDP, and FSDP2 (`fully_shard` on every block, then on the root)."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.spec import TrainSettings
from benchmarks.workers.common import ModelState, local_bytes, optimizer_state_bytes


def adamw(params: list[nn.Parameter], settings: TrainSettings) -> torch.optim.Optimizer:
    """torch AdamW with the fused CPU kernel: the same arithmetic zeroshard's "AdamW" config uses."""
    return torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay, fused=True
    )


class TorchTrainer:
    """One `loss.backward(); optimizer.step()` loop over a wrapped module."""

    def __init__(self, module: nn.Module, settings: TrainSettings):
        self.module = module
        self.params = list(module.parameters())
        self.optimizer = adamw(self.params, settings)
        self._grad_bytes = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.module(x, y)
        loss.backward()
        self._grad_bytes = local_bytes(p.grad for p in self.params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def model_state(self) -> ModelState:
        parts = {
            "params": local_bytes(self.params),
            "gradients": self._grad_bytes,
            "optimizer_state": optimizer_state_bytes(self.optimizer),
        }
        return ModelState(sum(parts.values()), parts, "measured")

    def engine_comm_bytes(self) -> float | None:
        return None


def build_ddp(model: nn.Module, settings: TrainSettings) -> TorchTrainer:
    from torch.nn.parallel import DistributedDataParallel

    return TorchTrainer(DistributedDataParallel(model), settings)


def build_fsdp2(model: nn.Module, settings: TrainSettings) -> TorchTrainer:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TorchTrainer(model, settings)
