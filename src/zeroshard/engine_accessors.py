"""DeepSpeed's engine accessors: what the config, the topology and the last step say, under DeepSpeed's names and
return types. A mixin of `Engine` (`class Engine(CheckpointMixin, EngineAccessors, nn.Module)`)."""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm.collectives import Collectives, CommStats
from zeroshard.comm.comms_logger import CommsLogger
from zeroshard.comm.topology import Topology
from zeroshard.config.optimizer import DEEPSPEED_OPTIMIZERS
from zeroshard.engine_settings import DeepSpeedSettings
from zeroshard.monitor import Telemetry
from zeroshard.monitor.wall_clock import WallClock
from zeroshard.runtime.schedules import TrainingSchedules
from zeroshard.sequence.mesh import SequenceParallel
from zeroshard.zero.strategy import AccumulationState


class EngineAccessors(DeepSpeedSettings):
    """Read-only views of the engine's state; every value comes from the attributes below (the config's under
    DeepSpeed's names: [Note: DeepSpeed's configuration accessors] in engine_settings.py)."""

    config: Any  # ZeroshardConfig
    topology: Topology
    comm: Collectives
    accumulation: AccumulationState
    basic_optimizer: torch.optim.Optimizer | None
    loss_scaler: Any
    _last_grad_norm: float | None
    telemetry: Telemetry
    wall_clock: WallClock
    schedules: TrainingSchedules
    _step_applied: bool
    sequence: SequenceParallel | None = None  # set by initialize ([Note: sequence parallelism])
    mpu: Any = None  # the model-parallel unit `initialize` was given (tensor or sequence parallel), as DeepSpeed's

    def __getattr__(self, name: str) -> Any:
        """[Note: the model's attributes through the engine]
        As DeepSpeed's engine, an attribute the engine does not have is the model's: `engine.generate(...)`,
        `engine.gradient_checkpointing_enable()`, a custom method or attribute of the user's module. The engine's own
        names win (`engine.config` is the engine's config, as DeepSpeed's; `engine.module.config` the model's).
        torch's `nn.Module.__getattr__` (parameters, buffers, submodules) is asked first."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            modules = self.__dict__.get("_modules")
            module = modules.get("module") if modules is not None else None
            if module is not None and not (name.startswith("__") and name.endswith("__")):
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    @property
    def num_experts(self) -> list[int]:
        """DeepSpeed's: the expert count of each MoE layer (`zeroshard.moe.MoE`) in the model, in module order."""
        from zeroshard.moe.layer import MoE

        module: torch.nn.Module = self.module  # type: ignore[attr-defined]
        return [m.num_experts for m in module.modules() if isinstance(m, MoE)]

    @property
    def has_moe_layers(self) -> bool:
        """DeepSpeed's: whether the model holds MoE layers."""
        return bool(self.num_experts)

    @property
    def zero_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    @property
    def comm_stats(self) -> CommStats:
        return self.comm.stats

    @property
    def comms_logger(self) -> CommsLogger:
        """The `comms_logger` block's records of the engine's collectives: `engine.comms_logger.log_all()`."""
        return self.comm.logger

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def global_rank(self) -> int:
        return self.topology.rank

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation.gradient_accumulation_steps

    def managed_gradient_accumulation(self) -> bool:
        """False when the caller owns the accumulation windows ([Note: caller-owned windows])."""
        return self.accumulation.managed

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.accumulation.is_boundary()

    def get_global_grad_norm(self) -> torch.Tensor | None:
        """Norm of the last step's gradients (before clipping) as a 0-dim fp32 tensor, DeepSpeed's type (scripts call
        `.item()` on it); inf after a step skipped for inf/nan gradients (as DeepSpeed's ZeRO); None before the first
        step or where the step computes none (`compute_grad_norm: false`)."""
        norm = self._last_grad_norm
        return None if norm is None else torch.tensor(norm, dtype=torch.float32)

    # DeepSpeed's names for what the config and topology already say (DeepSpeed's return types).
    @property
    def local_rank(self) -> int:
        return self.topology.local_rank

    @property
    def dp_world_size(self) -> int:
        """Data-parallel replicas: the ranks ZeRO shards over (the world divided by the tensor-parallel size, the
        pipeline engine's by its stages), divided by the sequence-parallel size."""
        return self.comm.world_size // self.sequence_parallel_size

    # Ulysses sequence parallelism under DeepSpeed's names ([Note: sequence parallelism]).
    @property
    def sequence_parallel_size(self) -> int:
        return self.sequence.size if self.sequence is not None else 1

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks ZeRO shards and reduces over (DeepSpeed's sequence-data-parallel group)."""
        return self.comm.world_size

    @property
    def seq_parallel_group(self) -> Any:
        """The sequence-parallel process group; None without sequence parallelism."""
        if self.sequence is None:
            return None
        return self.sequence.sp.group if self.sequence.sp.group is not None else torch.distributed.group.WORLD

    def get_sequence_parallel_group(self) -> Any:
        return self.seq_parallel_group

    # DeepSpeed's engine attributes for its groups (utils.groups, which follows the latest engine: [Note: groups follow
    # the engine])
    @property
    def data_parallel_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (the tensor- and sequence-parallel ranks apart)."""
        from zeroshard.utils import groups

        return groups._get_data_parallel_group()

    @property
    def seq_data_parallel_group(self) -> Any:
        """The group ZeRO shards and reduces over: the data- and sequence-parallel ranks together."""
        from zeroshard.utils import groups

        return groups._get_sequence_data_parallel_group()

    @property
    def mp_world_size(self) -> int:
        """The model-parallel (tensor-parallel) size; 1 without it."""
        from zeroshard.utils import groups

        return int(groups._get_model_parallel_world_size())

    @property
    def checkpoint_mp_rank(self) -> int:
        """The model-parallel rank a checkpoint's files are named by (0 without model parallelism)."""
        return self.get_model_parallel_rank() if self.mp_world_size > 1 else 0

    def get_wall_clock_timers(self) -> dict[str, float]:
        """With `wall_clock_breakdown`: each timer's milliseconds at the last `engine.step()` ([Note: wall clock
        breakdown]); empty without it, as DeepSpeed's."""
        return self.wall_clock.snapshot()

    def get_pld_theta(self) -> float | None:
        """Progressive Layer Dropping's keep probability after the last step; None without the block ([Note:
        progressive layer drop])."""
        return self.schedules.pld.get_theta() if self.schedules.pld is not None else None

    def curriculum_enabled_legacy(self) -> bool:
        """Whether the legacy top-level `curriculum_learning` block is on ([Note: legacy curriculum learning])."""
        return self.schedules.curriculum is not None

    def curriculum_params_legacy(self) -> dict[str, Any] | bool:
        """The legacy `curriculum_learning` block without its `enabled` key; False when it is absent, as
        DeepSpeed's."""
        if "curriculum_learning" not in self.config.raw:
            return False
        block = self.config.curriculum_learning.to_dict(include_defaults=False)
        return {k: v for k, v in block.items() if k != "enabled"}

    @property
    def monitor(self) -> Telemetry:
        """DeepSpeed's MonitorMaster: `enabled` when a monitor block is, `write_events` for the script's own events,
        `tb_monitor`/`wandb_monitor`/`csv_monitor`/`comet_monitor` (the enabled ones, on rank 0; None elsewhere)."""
        return self.telemetry

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def fp16_auto_cast(self) -> bool:
        """`fp16.auto_cast`: the forward's floating-point positional inputs are cast to fp16."""
        return bool(self.config.fp16.auto_cast)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage > 0), as DeepSpeed's `zero_optimization()`."""
        return self.zero_stage > 0

    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def optimizer_name(self) -> str | None:
        """ds_config `optimizer.type` (lower-cased for DeepSpeed's own optimizer names, as DeepSpeed does), or
        the client optimizer's class name when the config names none."""
        if self.config.optimizer is not None:
            name = str(self.config.optimizer.type)
            return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name
        return type(self.basic_optimizer).__name__ if self.basic_optimizer is not None else None

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` updated the parameters (False off the boundary or when it was skipped)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        if self.basic_optimizer is None:
            return []
        return [float(group["lr"]) for group in self.basic_optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0
