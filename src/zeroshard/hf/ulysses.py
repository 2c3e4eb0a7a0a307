"""Ulysses sequence parallelism in the Hugging Face Trainer (ALST): `TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=P, sp_handler=DeepSpeedSequenceParallelConfig(...)))` with
`zeroshard.hf.Trainer`.

[Note: the Trainer's sequence parallelism]
transformers routes this setting to DeepSpeed at three points: accelerate registers `UlyssesSPAttentionHF` and passes
its mpu to `deepspeed.initialize`; `Trainer._inner_training_loop` wraps the training dataloader in
`UlyssesSPDataLoaderAdapter` through `accelerator.deepspeed_ulysses_dl_adapter`; `Trainer.compute_loss` turns each
rank's loss over its part of the sequence into the whole sequence's, weighted by the parts' valid tokens
(`deepspeed_sp_compute_loss`, which reads DeepSpeed's groups). zeroshard takes the same three points with its own
wrapper, adapter and the engine's sequence-parallel group, so neither DeepSpeed nor accelerate's DeepSpeed plugin is
involved. The accelerator itself is built without the setting (accelerate accepts it only beside FSDP2 or DeepSpeed
and would refuse it on CPU) and answers it back (`EngineAccelerator.parallelism_config`), so the Trainer's batch
arithmetic (`get_sp_size`: P micro-batches per gathered batch, world / P replicas) runs as under DeepSpeed. The
gradient is then P times the single-process one, in DeepSpeed and here alike (the README's sequence-parallelism
section: the loss's differentiable all-gather and the engine both sum over the sample's ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather

from zeroshard.errors import ConfigError


def ulysses_parallelism(args: Any) -> Any:
    """The arguments' ParallelismConfig when it asks for Ulysses (sp_backend "deepspeed", sp_size > 1), else None."""
    pc = getattr(args, "parallelism_config", None)
    if pc is None or getattr(pc, "sp_size", 1) <= 1:
        return None
    if pc.sp_backend != "deepspeed":
        raise ConfigError(f"parallelism_config.sp_backend={pc.sp_backend!r}: Ulysses needs sp_backend='deepspeed'")
    if pc.tp_size > 1 or pc.cp_size > 1:
        raise ConfigError("parallelism_config: sp_size > 1 with tp_size or cp_size > 1 is refused")
    return pc


def register(model: Any, pc: Any, micro_batch_size: int) -> Any:
    """Wrap the model's attention ([Note: Ulysses for Hugging Face models]); the mpu for `initialize`."""
    from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    _refuse_recurrent_layers(model)
    handler = pc.sp_handler
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=handler.sp_attn_implementation,
        sequence_parallel_size=pc.sp_size,
        micro_batch_size=micro_batch_size,
        seq_length=handler.sp_seq_length,
        seq_length_is_variable=handler.sp_seq_length_is_variable,
        disable_in_eval=True,
    )


def _refuse_recurrent_layers(model: Any) -> None:
    """Linear-attention layers carry a state along the sequence inside the model's own code, not through the
    attention Ulysses wraps: split over ranks, each part restarts it and the gradients are silently wrong
    (accelerate refuses them the same way)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError("sequence parallelism wraps a Hugging Face model's attention: the model has no .config")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    recurrent = sorted({t for t in getattr(config, "layer_types", None) or [] if "linear_attention" in t})
    if recurrent:
        raise ConfigError(
            f"sequence parallelism with layers of type {recurrent} ({type(model).__name__}): they carry a recurrent "
            "state along the sequence that each rank would restart; use a full-attention model or sp_size 1"
        )


def adapt_dataloader(dataloader: Any, engine: Any, device: torch.device) -> Any:
    """The training dataloader in sequence parts for the engine's sequence-parallel group."""
    from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    group = engine.seq_parallel_group
    return UlyssesSPDataLoaderAdapter(
        dataloader,
        sp_rank=dist.get_rank(group),
        sp_group=group,
        sp_world_size=dist.get_world_size(group),
        device=device,
    )


def sequence_parallel_loss(engine: Any, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
    """[Note: the Trainer's sequence parallelism] the whole sequence's loss from this rank's part: the parts' mean
    losses all-gathered (differentiably) and weighted by their valid tokens (a part with none counts zero)."""
    if "labels" not in inputs and "shift_labels" in inputs:
        inputs["labels"] = inputs["shift_labels"]  # the model's loss reads shift_labels; labels makes it compute one
    outputs = model(**inputs)
    group = engine.seq_parallel_group
    losses = torch.stack(all_gather(outputs.loss, group=group))
    tokens = (inputs["shift_labels"] != -100).sum()
    counts = torch.stack(all_gather(tokens, group=group))
    weighted = torch.where(counts > 0, losses, torch.zeros_like(losses)) * counts
    loss = weighted.sum() / counts.sum().clamp(min=1)
    return (loss, outputs) if return_outputs else loss
