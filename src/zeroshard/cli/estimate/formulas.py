"""Bytes per rank of the ZeRO model states, by stage and offload choice: pure arithmetic, no torch.

[Note: two accountings]
`zeroshard_states` follows zeroshard's own buffers (docs/design.md): gradients are accumulated in
fp32 by default, so stage 2 holds 4Ψ/N of gradients where the ZeRO paper has 2Ψ/N; the fp32 master
copy is skipped when it would alias the fp32 parameters (fp32 training unsharded, or stage 3); with the
optimizer offloaded to the CPU the host holds an fp32 copy of the gradient shard, and the device the gradient
buffers it keeps without offload, except stage 3's shard, released once copied when nothing is accumulated into it
(DeepSpeed's estimators count no gradients on the GPU and no copy on the host). `engine.memory_report()` measures the
same quantities (`model_states` the device's, the `host_*` columns the host's). `deepspeed_states` reproduces
DeepSpeed's `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
(zero_init=True for stage 3), including their 1.5x CPU buffer factor; DeepSpeed has no estimator
for stages 0 and 1 and for NVMe, so those are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from zeroshard.zero.quant import DEFAULT_BLOCK_SIZE

OFFLOAD_CHOICES: Final = ("none", "cpu", "nvme")
ADDITIONAL_BUFFER_FACTOR: Final = 1.5  # DeepSpeed's default


@dataclass(frozen=True)
class Option:
    """One ZeRO configuration: stage and where optimizer state / parameters live."""

    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "offload_optimizer": self.offload_optimizer, "offload_param": self.offload_param}

    def label(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"offload_optimizer={self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"offload_param={self.offload_param}")
        return ", ".join(parts)


# Every stage x offload combination DeepSpeed accepts: parameter offload and NVMe need stage 3.
OPTIONS: Final = (
    Option(0),
    Option(1),
    Option(1, "cpu"),
    Option(2),
    Option(2, "cpu"),
    Option(3),
    Option(3, "cpu"),
    Option(3, "cpu", "cpu"),
    Option(3, "nvme", "nvme"),
)


@dataclass(frozen=True)
class Precision:
    """Bytes per element: parameters (compute dtype), gradient accumulation, optimizer state per parameter,
    gradient communication (None: the compute dtype, DeepSpeed's default), master weights (2 with
    `bf16_master_weights_and_grads`: [Note: bf16 master weights] in optim/state_dtype.py)."""

    param_bytes: int = 2
    grad_bytes: int = 4
    # per trainable element: Adam/AdamW's m and v in fp32; Muon's average over its matrices (momentum, 4) and the
    # rest (Adam, 8)
    optimizer_bytes: float = 8
    comm_bytes: int | None = None
    master_bytes: int = 4
    # zero_quantized_nontrainable_weights: stage 3 holds frozen weights as 8-bit blocks ([Note: quantized frozen
    # weights] in zero/stage3/packed.py)
    quantized_frozen: bool = False

    @property
    def reduce_bytes(self) -> int:
        return self.param_bytes if self.comm_bytes is None else self.comm_bytes


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 1
    nodes: int = 1

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's model states, by kind, and by the tier that holds them."""

    params: int
    gradients: int
    master_weights: int
    optimizer_state: int
    gpu: int
    cpu: int
    nvme: int

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.master_weights + self.optimizer_state


def zeroshard_states(
    psi: int,
    option: Option,
    precision: Precision,
    world_size: int,
    gradient_accumulation_steps: int = 1,
    frozen: int = 0,
) -> ModelStates:
    """Per-rank model-state bytes of `psi` trainable parameters and `frozen` ones (see [Note: two accountings]).

    Stage 3 without accumulation keeps its gradient shard in the communication dtype (nothing is
    accumulated into it), with accumulation in the accumulation dtype; stages 0-2 always accumulate, stage 1 into a
    full accumulator only with accumulation ([Note: stage 1's accumulator on demand] in zero/flat/reducer.py: a
    `no_sync()` backward allocates it at one micro-step too, which this does not foresee). A frozen
    parameter (a LoRA base) is its compute-dtype weight only, sharded at stage 3 ([Note: frozen parameters at
    stage 3] in zero/stage3/unit.py), 1 + 4/256 bytes with `precision.quantized_frozen` (see below).
    """
    n = world_size
    p, g, k = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
    if option.stage == 3 and gradient_accumulation_steps == 1:
        g = precision.reduce_bytes
    sharded_states = option.stage >= 1 and n > 1
    # the trainable elements a rank holds masters, gradients and state for: its 1/N (at stage 3 the trainable and
    # the frozen parameters of a unit are each split evenly: [Note: frozen parameters at stage 3])
    trained = psi // n
    if option.stage == 3 and precision.quantized_frozen:
        # a rank keeps its 1/N of the trainable elements in the compute dtype, its 1/N of the frozen ones as int8
        params = p * trained + quantized_bytes(frozen // n)
    elif option.stage == 3:
        params = p * (psi + frozen) // n
    else:
        params = p * (psi + frozen)
    if option.stage == 0 or (option.stage == 1 and (gradient_accumulation_steps > 1 or n == 1)):
        # one full accumulator; its front is the reduce-scattered shard at stage 1 ([Note: stage 1's shard inside
        # its accumulator] in zero/flat/reducer.py), and it is its own shard when nothing is sharded
        grads = g * psi
    else:
        grads = g * trained
    # masters are the parameters themselves where both have the same dtype and extent (unsharded, or stage 3) and
    # live on the same tier.
    # (stages 0-2 keep the parameters on the device: offloaded masters are a host copy even when unsharded)
    same_tier = option.offload_param == option.offload_optimizer
    m = precision.master_bytes
    master_aliases = p == m and (option.stage == 3 or not sharded_states) and same_tier
    master = 0 if master_aliases else (m * trained if option.stage >= 1 else m * psi)
    optim = int(k * trained) if option.stage >= 1 else int(k * psi)
    tiers = {"gpu": 0, "cpu": 0, "nvme": 0}
    tiers[_tier(option.offload_param)] += params
    tiers[_tier(option.offload_optimizer)] += master + optim
    # The device keeps the gradient buffers it keeps without offload; optimizer offload to the CPU adds the fp32
    # copy of the shard the host optimizer reads ([Note: gradients to the host during backward]), and at stage 3
    # without accumulation the device shard is released once that copy holds it ([Note: a gradient shard leaves
    # once its host copy holds it]); stage 3 with NVMe writes each gradient shard next to the optimizer state
    # instead (ZeRO-Infinity).
    nvme_grads = option.stage == 3 and option.offload_optimizer == "nvme"
    if option.stage == 3 and option.offload_optimizer == "cpu" and gradient_accumulation_steps == 1:
        grads = 0
    tiers["nvme" if nvme_grads else "gpu"] += grads
    if option.offload_optimizer == "cpu":
        copies = m * trained  # in the masters' dtype
        tiers["cpu"] += copies
        grads += copies
    return ModelStates(params, grads, master, optim, tiers["gpu"], tiers["cpu"], tiers["nvme"])


def _tier(device: str) -> str:
    return "gpu" if device == "none" else device


def deepspeed_states(
    psi: int, largest_layer: int, option: Option, cluster: Cluster, factor: float = ADDITIONAL_BUFFER_FACTOR
) -> tuple[int, int] | None:
    """(cpu bytes per node, gpu bytes per GPU) from DeepSpeed's estimators, or None where it has none."""
    gpus, nodes, total = cluster.gpus_per_node, cluster.nodes, cluster.world_size
    if option.stage == 2 or (option.stage == 1 and option.offload_optimizer == "cpu"):
        if option.stage == 1:
            return None
        if option.offload_optimizer == "cpu":
            return int(psi * max(4 * total, 16) * factor), int(2 * psi)
        return int(psi * 4 * gpus * factor), int(2 * psi + int(18 * psi / total))
    if option.stage != 3 or option.offload_optimizer == "nvme":
        return None
    largest = 4 * largest_layer
    if option.offload_optimizer == "cpu" and option.offload_param == "cpu":
        return int(psi * 18 / nodes * factor), int(largest)
    if option.offload_optimizer == "cpu":
        return int(psi * 16 / nodes * factor), int(largest + int(2 * psi / total))
    return int(largest_layer * 4 * gpus * factor), int(largest + int(18 * psi / total))


def gather_buffer_bytes(option: Option, largest_layer: int, precision: Precision) -> int:
    """Stage 3 holds a gathered copy of the unit being computed and its gradient (DeepSpeed: 4 x largest layer)."""
    return 2 * precision.param_bytes * largest_layer if option.stage == 3 else 0


def comm_buffer_bytes(option: Option, psi: int, bucket_numel: int, comm_bytes: int) -> int:
    """Reduce buckets in flight: one being filled and one being reduced (none for stage 0 with a full accumulator)."""
    if option.stage == 0:
        return 0
    return 2 * min(bucket_numel, psi) * comm_bytes


def load_bytes_per_rank(option: Option, psi: int, largest_layer: int) -> int:
    """Host memory to build the model before sharding: fp32 in every process, one layer at a time with stage 3."""
    return 4 * largest_layer if option.stage == 3 else 4 * psi


def quantized_bytes(numel: int) -> int:
    """Bytes of `numel` elements as 8-bit codes with one fp32 scale per block of 256 ([Note: block quantization])."""
    return numel + 4 * -(-numel // DEFAULT_BLOCK_SIZE)
