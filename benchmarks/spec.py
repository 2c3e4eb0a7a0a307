"""What a benchmark row is: the framework variant, the model size, the ranks and the training settings.

[Note: the variant table]
`VARIANTS` lists every framework x stage the runner knows, in the order rows run (frameworks
alternate so a slow drift of the machine does not land on one framework). A new row is one line.
A variant may name the zeroshard config keys it needs (`needs`); while
`zeroshard.config.support.is_unimplemented` lists one of them, the row is reported as
"not implemented yet" instead of silently running without the feature.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FRAMEWORKS = ("ddp", "fsdp2", "deepspeed", "zeroshard")


@dataclass(frozen=True)
class Variant:
    """One framework configuration; `stage` is the ZeRO stage it corresponds to (DDP 0, FSDP2 3)."""

    key: str
    framework: str
    stage: int
    label: str
    offload: bool = False
    needs: tuple[str, ...] = ()  # zeroshard config keys that must be implemented for the row to run
    backend: str = "zero"  # zeroshard rows: "zeroshard": {"backend": ...} (docs/fsdp2.md)
    host_alloc: str = ""  # zeroshard rows: ZEROSHARD_HOST_ALLOC for the row ([Note: glibc's mmap threshold])
    compiled: bool = False  # zeroshard rows: engine.compile() (inductor) before the first step
    by_default: bool = True  # False: runs only when --variants (or a preset) names it


VARIANTS: tuple[Variant, ...] = (
    Variant("ddp", "ddp", 0, "DDP"),
    Variant("zs0", "zeroshard", 0, "zeroshard ZeRO-0"),
    Variant("ds1", "deepspeed", 1, "DeepSpeed ZeRO-1"),
    Variant("zs1", "zeroshard", 1, "zeroshard ZeRO-1"),
    Variant("ds2", "deepspeed", 2, "DeepSpeed ZeRO-2"),
    Variant("zs2", "zeroshard", 2, "zeroshard ZeRO-2"),
    Variant("zs2f", "zeroshard", 2, "zeroshard ZeRO-2 on FSDP2", backend="fsdp2"),
    Variant("fsdp2", "fsdp2", 3, "FSDP2"),
    Variant("ds3", "deepspeed", 3, "DeepSpeed ZeRO-3"),
    Variant("zs3", "zeroshard", 3, "zeroshard ZeRO-3"),
    Variant("zs3f", "zeroshard", 3, "zeroshard ZeRO-3 on FSDP2", backend="fsdp2"),
    Variant("zs3g", "zeroshard", 3, "zeroshard ZeRO-3, glibc's allocator", host_alloc="glibc"),
    Variant(
        "zs3fg",
        "zeroshard",
        3,
        "zeroshard ZeRO-3 on FSDP2, glibc's allocator",
        backend="fsdp2",
        host_alloc="glibc",
        by_default=False,
    ),
    Variant("zs0c", "zeroshard", 0, "zeroshard ZeRO-0, compiled", compiled=True, by_default=False),
    Variant("zs2c", "zeroshard", 2, "zeroshard ZeRO-2, compiled", compiled=True, by_default=False),
    Variant("zs3c", "zeroshard", 3, "zeroshard ZeRO-3, compiled", compiled=True, by_default=False),
    Variant("ds2off", "deepspeed", 2, "DeepSpeed ZeRO-2 + CPU offload", offload=True),
    Variant(
        "zs2off",
        "zeroshard",
        2,
        "zeroshard ZeRO-2 + CPU offload",
        offload=True,
        needs=("zero_optimization.offload_optimizer",),
    ),
)
VARIANTS_BY_KEY: dict[str, Variant] = {v.key: v for v in VARIANTS}


@dataclass(frozen=True)
class TrainSettings:
    """Identical for every framework: same model, seed, global batch and optimizer hyperparameters."""

    size: str
    micro_batch: int = 1  # samples per rank per step; the global batch is micro_batch x world_size
    seq_len: int | None = None  # tokens per sample; None: the preset's block_size
    steps: int = 12  # warm-up + timed
    warmup: int = 2
    seed: int = 1234
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    bucket_numel: int = 6_250_000  # ZeRO reduce/all-gather bucket (elements) for DeepSpeed and zeroshard
    threads: int = 1  # intra-op threads per rank
    lora_rank: int = 0  # > 0: peft LoRA adapters of this rank on every block's linear layers, the rest frozen

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup


@dataclass(frozen=True)
class RowSpec:
    """One row: a variant trained with `settings` on `world_size` ranks."""

    variant: Variant
    settings: TrainSettings
    world_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def row_id(self) -> str:
        return f"{self.variant.key}-{self.settings.size}-n{self.world_size}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> RowSpec:
        raw = json.loads(text)
        settings = dict(raw["settings"])
        settings["betas"] = tuple(settings["betas"])
        variant = dict(raw["variant"])
        variant["needs"] = tuple(variant["needs"])
        return RowSpec(Variant(**variant), TrainSettings(**settings), int(raw["world_size"]), raw.get("extra", {}))
