"""DeepSpeed rows: ZeRO-1/2/3 (and CPU offload) on its CPU accelerator with gloo, same ds_config as ours."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.spec import RowSpec
from benchmarks.workers.common import ModelState, optimizer_state_bytes, tensor_bytes
from benchmarks.workers.zeroshard_worker import ds_config


class DeepSpeedTrainer:
    def __init__(self, model: nn.Module, spec: RowSpec):
        import deepspeed

        self.spec = spec
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)  # the gradients' count
        if str(ds_config(spec)["optimizer"]["type"]).lower() == "muon":
            # DeepSpeed wraps its Newton-Schulz in torch.compile, which would compile for minutes on the CPU; the
            # zeroshard rows run theirs eagerly too
            torch._dynamo.config.disable = True
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(spec)
        )

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def model_state(self) -> ModelState:
        """Parameters, fp32 master partitions and optimizer state read from DeepSpeed's optimizer;
        gradients from the ZeRO formula (DeepSpeed frees or reuses them inside its buffers)."""
        opt: Any = self.optimizer
        stage = self.spec.variant.stage
        n = self.spec.world_size
        if stage == 3:
            params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self.engine.module.parameters())
            master = tensor_bytes(getattr(opt, "fp32_partitioned_groups_flat", []))
        else:
            params = tensor_bytes(self.engine.module.parameters())
            master = tensor_bytes(getattr(opt, "single_partition_of_fp32_groups", []))
        inner = getattr(opt, "optimizer", opt)
        state = optimizer_state_bytes(inner)
        # stage 1 too: at gradient_accumulation_steps 1 every backward is a boundary, where DeepSpeed reduces through
        # its contiguous bucket and keeps only its partition (reduce_ready_partitions_and_remove_grads)
        grads = round(4 * self.numel / n)
        parts = {"params": params, "gradients": grads, "master_weights": master, "optimizer_state": state}
        return ModelState(sum(parts.values()), parts, "measured, gradients theory")

    def engine_comm_bytes(self) -> float | None:
        return None
