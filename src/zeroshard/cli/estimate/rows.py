"""One estimate row per ZeRO option: model states, activations and buffers, by tier (GPU, CPU, NVMe)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from zeroshard.cli.estimate.activations import activation_bytes
from zeroshard.cli.estimate.formulas import (
    OPTIONS,
    Cluster,
    ModelStates,
    Option,
    Precision,
    comm_buffer_bytes,
    deepspeed_states,
    gather_buffer_bytes,
    load_bytes_per_rank,
    zeroshard_states,
)
from zeroshard.cli.estimate.shapes import ModelInfo

DEFAULT_BUCKET_NUMEL = 500_000_000  # DeepSpeed's reduce_bucket_size default
NVME_BUFFER_NUMEL = 100_000_000  # DeepSpeed's offload buffer_size default
NVME_PARAM_BUFFERS, NVME_OPTIMIZER_BUFFERS = 5, 4  # DeepSpeed's buffer_count defaults


@dataclass(frozen=True)
class Row:
    option: Option
    states: ModelStates  # per rank
    activation_bytes: int  # per rank
    buffer_bytes: int  # per rank on the GPU: reduce buckets, stage-3 gathered unit
    gpu_bytes_per_rank: int
    cpu_bytes_per_node: int
    nvme_bytes_per_node: int
    deepspeed: tuple[int, int] | None  # DeepSpeed's (cpu per node, gpu per GPU), model states only

    def to_json(self) -> dict[str, Any]:
        return {
            **self.option.to_json(),
            "gpu_bytes_per_rank": self.gpu_bytes_per_rank,
            "cpu_bytes_per_node": self.cpu_bytes_per_node,
            "nvme_bytes_per_node": self.nvme_bytes_per_node,
            "model_states_bytes_per_rank": {
                "params": self.states.params,
                "gradients": self.states.gradients,
                "master_weights": self.states.master_weights,
                "optimizer_state": self.states.optimizer_state,
                "total": self.states.total,
                "on_gpu": self.states.gpu,
                "on_cpu": self.states.cpu,
                "on_nvme": self.states.nvme,
            },
            "activation_bytes_per_rank": self.activation_bytes,
            "buffer_bytes_per_rank": self.buffer_bytes,
            "deepspeed_cpu_bytes_per_node": None if self.deepspeed is None else self.deepspeed[0],
            "deepspeed_gpu_bytes_per_rank": None if self.deepspeed is None else self.deepspeed[1],
        }


def estimate_rows(
    model: ModelInfo,
    cluster: Cluster,
    precision: Precision,
    seq_len: int,
    micro_batch: int,
    checkpointing: bool = False,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    grad_accum: int = 1,
    trainable: int | None = None,
    autoep: int = 1,
) -> list[Row]:
    """A row for every option in `OPTIONS`; `trainable` parameters of the model's (default: all), the rest frozen.
    bf16 masters (`precision.master_bytes` 2) exist at stages 1-3 only, as in DeepSpeed: no stage-0 row. With
    `autoep` > 1 (`expert_parallel.autoep_size`) the routed experts are split over that many ranks and data-parallel
    over the rest, at stages 1-3 without NVMe ([Note: AutoEP] in moe/auto.py, [Note: experts at stage 3] in
    moe/stage3.py)."""
    acts = activation_bytes(model.shape, seq_len, micro_batch, precision.param_bytes, checkpointing)
    psi = model.params if trainable is None else trainable
    options = [o for o in OPTIONS if o.stage > 0 or precision.master_bytes == 4]
    if autoep > 1:
        options = [o for o in options if o.stage > 0 and "nvme" not in (o.offload_optimizer, o.offload_param)]
    return [_row(model, option, cluster, precision, acts, bucket_numel, grad_accum, psi, autoep) for option in options]


def _states(
    model: ModelInfo, option: Option, precision: Precision, n: int, accum: int, psi: int, ep: int
) -> ModelStates:
    """Per-rank model states; with `ep` > 1 the dense part over all `n` ranks plus this rank's `1/ep` of the
    experts over their `n/ep` expert-data-parallel ranks. The trainable count fills the dense part first (a LoRA
    on attention leaves the experts frozen)."""
    if ep == 1:
        return zeroshard_states(psi, option, precision, n, accum, model.params - psi)
    dense = model.params - model.experts
    dense_psi = min(psi, dense)
    experts_psi = psi - dense_psi
    parts = [
        zeroshard_states(dense_psi, option, precision, n, accum, dense - dense_psi),
        zeroshard_states(experts_psi // ep, option, precision, n // ep, accum, (model.experts - experts_psi) // ep),
    ]
    return ModelStates(*(sum(getattr(p, f.name) for p in parts) for f in fields(ModelStates)))


def _row(
    model: ModelInfo,
    option: Option,
    cluster: Cluster,
    precision: Precision,
    acts: int,
    bucket_numel: int,
    grad_accum: int,
    psi: int,
    autoep: int = 1,
) -> Row:
    """The row of `option`, given the activation bytes per rank (the same for every option) and the trainable
    parameter count `psi`."""
    n = cluster.world_size
    frozen = model.params - psi
    states = _states(model, option, precision, n, grad_accum, psi, autoep)
    buffers = gather_buffer_bytes(option, model.largest_unit(autoep), precision) + comm_buffer_bytes(
        option, psi, bucket_numel, precision.reduce_bytes
    )
    staging = 0
    if option.offload_param == "nvme":
        staging += NVME_PARAM_BUFFERS * min(NVME_BUFFER_NUMEL, model.params) * precision.param_bytes
    if option.offload_optimizer == "nvme":
        staging += NVME_OPTIMIZER_BUFFERS * min(NVME_BUFFER_NUMEL, model.params // n) * 4
    # (with AutoEP too: at stage 3 a model built under zero_init from a checkpoint reads each rank's experts' rows
    # unit by unit, [Note: AutoEP under zero_init])
    cpu_rank = max(load_bytes_per_rank(option, model.params, model.largest_layer), states.cpu + staging)
    return Row(
        option=option,
        states=states,
        activation_bytes=acts,
        buffer_bytes=buffers,
        gpu_bytes_per_rank=states.gpu + acts + buffers,
        cpu_bytes_per_node=cpu_rank * cluster.gpus_per_node,
        nvme_bytes_per_node=states.nvme * cluster.gpus_per_node,
        # DeepSpeed's estimators count every parameter as trainable, with fp32 masters: no column for a frozen base
        # or bf16 masters
        deepspeed=None
        if frozen or precision.master_bytes != 4 or autoep > 1
        else deepspeed_states(model.params, model.largest_layer, option, cluster),
    )
