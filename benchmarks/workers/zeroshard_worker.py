"""zeroshard rows: the same ds_config block DeepSpeed gets, through `zeroshard.initialize`."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from benchmarks.spec import RowSpec
from benchmarks.workers.common import ModelState, NotImplementedRow
from zeroshard.memory import ProcessMemory


def ds_config(spec: RowSpec) -> dict[str, Any]:
    """The ds_config both DeepSpeed and zeroshard rows are given (fp32, AdamW unless the run names another optimizer,
    no clipping)."""
    s = spec.settings
    zero: dict[str, Any] = {
        "stage": spec.variant.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": s.bucket_numel,
        "allgather_bucket_size": s.bucket_numel,
    }
    if spec.variant.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    zero.update(spec.extra.get("zero_overrides", {}))
    backend = {"zeroshard": {"backend": spec.variant.backend}} if spec.variant.backend != "zero" else {}
    optimizer = spec.extra.get("optimizer") or {
        "type": "AdamW",
        "params": {"lr": s.lr, "betas": list(s.betas), "eps": s.eps, "weight_decay": s.weight_decay},
    }
    return {
        **backend,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "gradient_clipping": 0.0,  # DeepSpeed and zeroshard default to 1.0; DDP and FSDP2 do not clip
        "optimizer": optimizer,
        "zero_optimization": zero,
    }


def _unimplemented(keys: tuple[str, ...]) -> list[str]:
    from zeroshard.config.support import is_unimplemented

    return [k for k in keys if is_unimplemented(k)]


class ZeroshardTrainer:
    def __init__(self, model: nn.Module, spec: RowSpec):
        import zeroshard
        from zeroshard.errors import ConfigError

        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch model_state() runs again
        if spec.variant.host_alloc:  # read by initialize ([Note: glibc's mmap threshold])
            os.environ["ZEROSHARD_HOST_ALLOC"] = spec.variant.host_alloc
        missing = _unimplemented(spec.variant.needs)
        if missing:
            raise NotImplementedRow(f"zeroshard lists {', '.join(missing)} as not implemented yet")
        try:
            self.engine, _, _, _ = zeroshard.initialize(
                model=model, model_parameters=model.parameters(), config=ds_config(spec)
            )
        except (ConfigError, NotImplementedError) as err:
            raise NotImplementedRow(str(err).splitlines()[0]) from err
        if spec.variant.compiled:  # compiled during the warm-up steps
            self.engine.compile()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self._last = (x, y)
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def model_state(self) -> ModelState:
        """`memory_report().model_states` plus what an offload tier holds in host memory: on a CPU-only
        machine the host is the same RAM, and DeepSpeed's offload rows count their CPU states too. Read after one
        more backward (after the timed steps and the peak RSS): stage 3's gradient shards exist from backward to
        the step ([Note: gradient shards exist from reduction to step])."""
        assert self._last is not None, "model_state() after a train_step"
        self.engine.backward(self.engine(*self._last))
        report = self.engine.memory_report().to_dict()
        parts = {
            k: int(v)
            for k, v in report.items()
            if k not in ("rank", "world_size", "stage", "trainable_numel", "model_states")
            and k not in asdict(ProcessMemory())
            and v
        }
        host = sum(v for k, v in parts.items() if k.startswith("host_"))
        source = "measured (memory_report" + (", incl. host tier)" if host else ")")
        return ModelState(int(report["model_states"]) + host, parts, source)

    def engine_comm_bytes(self) -> float | None:
        return float(self.engine.comm_stats.total_bus_bytes)
