"""The ds_config of a `zeroshard train` run: a preset or a file, with "auto" filled from the command line.

This is what the Hugging Face Trainer's DeepSpeed integration does with its TrainingArguments: the
batch sizes, learning rate, warm-up, total steps, clipping and precision come from the command; a
value the config sets explicitly wins; anything else "auto" is left to `initialize` (bucket sizes
from the model's hidden size) and to DeepSpeed's defaults. A config without an optimizer or a
scheduler gets the presets' AdamW and WarmupCosineLR, as the Trainer would create its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.presets import ds_config_preset, fill_auto, load_ds_config


@dataclass(frozen=True)
class TrainHyper:
    """The command-line values a ds_config's "auto" entries can take."""

    micro_batch: int
    grad_accum: int
    lr: float
    weight_decay: float
    warmup_steps: int
    max_steps: int
    max_grad_norm: float
    dtype: str  # fp32, bf16 or fp16
    backend: str | None = None  # --backend: "zeroshard": {"backend": ...} (None: as the config says)

    def known(self, world_size: int) -> dict[str, object]:
        """Dotted ds_config paths and their values, as `fill_auto` and `resolve_config` take them."""
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": self.micro_batch * self.grad_accum * world_size,
            "optimizer.params.lr": self.lr,
            "optimizer.params.weight_decay": self.weight_decay,
            "scheduler.params.total_num_steps": self.max_steps,
            "scheduler.params.warmup_num_steps": self.warmup_steps,
            "scheduler.params.warmup_max_lr": self.lr,
            "scheduler.params.warmup_min_lr": 0.0,
            "gradient_clipping": self.max_grad_norm,
            "bf16.enabled": self.dtype == "bf16",
            "fp16.enabled": self.dtype == "fp16",
        }


# the command-line flags behind each "auto" path of `TrainHyper.known`
FLAG_PATHS = {
    "--micro-batch": ("train_micro_batch_size_per_gpu",),
    "--grad-accum": ("gradient_accumulation_steps",),
    "--lr": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "--weight-decay": ("optimizer.params.weight_decay",),
    "--warmup-steps": ("scheduler.params.warmup_num_steps",),
    "--max-steps": ("scheduler.params.total_num_steps",),
    "--max-grad-norm": ("gradient_clipping",),
    "--dtype": ("bf16.enabled", "fp16.enabled"),
}


def overridden_flags(source: str, hyper: TrainHyper, world_size: int, given: set[str]) -> list[str]:
    """One line per flag in `given` whose value the ds_config `source` replaces with a value of its own (the file
    wins, as under the HF Trainer's "auto" rules; transformers refuses such a mismatch, zeroshard train says it)."""
    config = load_ds_config(source)
    known = hyper.known(world_size)
    lines = []
    for flag in sorted(given & set(FLAG_PATHS)):
        for path in FLAG_PATHS[flag]:
            value: Any = config
            for key in path.split("."):
                value = value.get(key) if isinstance(value, Mapping) else None
            if value is not None and value != "auto" and value != known[path]:
                lines.append(
                    f'{flag} is not used for {path}: {source} sets {value!r} there (the file wins; write "auto" '
                    "there to take the flag)"
                )
                break
    return lines


def preset_name(stage: int, offload: bool) -> str:
    return f"zero{stage}_offload" if offload else f"zero{stage}"


def train_ds_config(source: str, hyper: TrainHyper, world_size: int) -> dict[str, Any]:
    """The config dict to pass to `initialize`: `source` (preset name or file) with "auto" filled."""
    config = load_ds_config(source)
    if config.get("managed_gradient_accumulation") is False:  # [Note: caller-owned windows]
        raise ConfigError(
            f"{source}: managed_gradient_accumulation is false, but zeroshard train ends a window every --grad-accum "
            "micro-batches itself; remove the key (it is for scripts that call engine.step() where their windows end)"
        )
    preset = ds_config_preset("zero2")
    for block in ("optimizer", "scheduler"):
        if block not in config:
            config[block] = preset[block]
    if hyper.backend is not None:
        config["zeroshard"] = {**config.get("zeroshard", {}), "backend": hyper.backend}
    return fill_auto(config, hyper.known(world_size))


def auto_paths(config: Mapping[str, Any], path: str = "") -> list[str]:
    """Dotted paths of every "auto" value in a raw config mapping."""
    found: list[str] = []
    for key, value in config.items():
        here = f"{path}.{key}" if path else key
        if isinstance(value, Mapping):
            found += auto_paths(value, here)
        elif value == "auto":
            found.append(here)
    return found
