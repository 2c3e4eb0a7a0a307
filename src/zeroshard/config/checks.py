"""Rules that involve more than one key. Values still "auto" are skipped; resolve_config runs the
rules again once every value is known."""

from __future__ import annotations

import logging
from typing import Any

from zeroshard.config.schedules import check_curriculum
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import ConfigError


def check_consistency(cfg: ZeroshardConfig) -> None:
    """Raise ConfigError when keys contradict each other (DeepSpeed's cross-key assertions)."""
    _check_precision(cfg)
    _check_zero(cfg)
    check_curriculum(cfg.curriculum_learning)
    _check_muon(cfg)
    writer = cfg.checkpoint.writer
    if writer is not None and writer.type == "MOCK":
        raise ConfigError(
            'checkpoint.writer.type "MOCK" (DeepSpeed\'s writer that discards the bytes) would commit checkpoints that '
            'cannot load; use "FAST" or "PYTHON" (both write with zeroshard\'s writer), or remove the writer block'
        )


def _check_muon(cfg: ZeroshardConfig) -> None:
    """What the Muon optimizer composes with ([Note: Muon on flat shards] in optim/muon.py); initialize refuses the
    model-level rest (a PipelineModule, tensor parallelism, MoE layers)."""
    optimizer = cfg.optimizer
    if optimizer is None or not isinstance(optimizer.type, str) or optimizer.type.lower() != "muon":
        return
    conflict = None
    if str(cfg.zeroshard.backend) == "fsdp2":
        conflict = 'zeroshard.backend "fsdp2" (Muon runs on the "zero" backend)'
    elif cfg.bf16.bf16_master_weights_and_grads is True or cfg.fp16.fp16_master_weights_and_grads is True:
        conflict = "bf16/fp16 master weights (Muon keeps fp32 masters)"
    elif isinstance(cfg.sequence_parallel_size, int) and cfg.sequence_parallel_size > 1:
        conflict = "sequence_parallel_size > 1"
    elif cfg.torch_autocast.enabled is True and cfg.bf16.enabled is not True:  # (beside bf16: only the forward's)
        conflict = "torch_autocast"
    if conflict is not None:
        raise ConfigError(f'optimizer.type "Muon" does not work with {conflict} yet; use AdamW, or remove that setting')


def _check_precision(cfg: ZeroshardConfig) -> None:
    fp16, bf16 = cfg.fp16, cfg.bf16
    if fp16.enabled is True and bf16.enabled is True:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
    if fp16.enabled is True and fp16.loss_scale == 0:
        for key in ("loss_scale_window", "min_loss_scale", "hysteresis"):
            value = getattr(fp16, key)
            if isinstance(value, int) and value <= 0:
                raise ConfigError(f"fp16.{key}: {value} is out of range; dynamic loss scaling needs > 0")
        power = fp16.initial_scale_power
        if isinstance(power, int) and not -126 <= power <= 127:  # 2**power a normal fp32 number
            raise ConfigError(
                f"fp16.initial_scale_power: {power} is out of range; the loss is multiplied by 2**power in fp32, so "
                "it must be between -126 and 127 (DeepSpeed's default is 16)"
            )
    if bf16.bf16_optimizer_states is True and bf16.bf16_master_weights_and_grads is not True:
        raise ConfigError("bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads to be true")
    for block, name in ((bf16, "bf16"), (fp16, "fp16")):  # [Note: bf16 master weights]
        key = f"{name}.{name}_master_weights_and_grads"
        if getattr(block, f"{name}_master_weights_and_grads") is not True:
            continue
        if block.enabled is False:
            raise ConfigError(
                f"{key} is true but {name}.enabled is false: {name} master weights need {name} training (set "
                f"{name}.enabled true, or remove {name}_master_weights_and_grads)"
            )
        if str(cfg.zeroshard.backend) == "fsdp2":
            raise ConfigError(
                f'{key} needs the "zero" backend (zeroshard.backend is "fsdp2", whose sharded parameters are the fp32 '
                "masters)"
            )
    autocast = cfg.torch_autocast
    if autocast.enabled is True:  # [Note: torch autocast]
        if fp16.enabled is True:
            raise ConfigError(
                "torch_autocast.enabled and fp16.enabled are two precision modes: keep one (torch_autocast keeps "
                "fp32 parameters and runs the forward under torch.autocast)"
            )
        if bf16.enabled is True and autocast.dtype not in (None, "bf16"):  # (a bf16 model's forward under autocast)
            raise ConfigError(
                f'torch_autocast.dtype "{autocast.dtype}" with bf16.enabled: the bf16 model\'s forward runs under '
                'autocast in bf16; set torch_autocast.dtype "bfloat16" or remove it'
            )
        if autocast.dtype == "fp16":
            raise ConfigError(
                'torch_autocast.dtype "fp16" needs a gradient scaler, which is not implemented with torch_autocast: '
                'use "bf16", or fp16.enabled for fp16 training with the loss scaler'
            )
    param_dtype = cfg.data_types.param_dtype
    if isinstance(param_dtype, str) and isinstance(fp16.enabled, bool) and isinstance(bf16.enabled, bool):
        model_dtype = "fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32"
        if param_dtype != model_dtype:  # DeepSpeed asserts this at initialize
            raise ConfigError(
                f'data_types.param_dtype "{param_dtype}" conflicts with the precision mode (parameters train in '
                f"{model_dtype}): set the matching fp16/bf16 enabled flag, or remove data_types.param_dtype"
            )


def _check_zero(cfg: ZeroshardConfig) -> None:
    zero = cfg.zero_optimization
    stage = zero.stage
    needs_zero = {
        "fp16.fp16_master_weights_and_grads": cfg.fp16.fp16_master_weights_and_grads,
        "bf16.bf16_master_weights_and_grads": cfg.bf16.bf16_master_weights_and_grads,
        "bf16.bf16_optimizer_states": cfg.bf16.bf16_optimizer_states,
    }
    for key, value in needs_zero.items():
        if value is True and stage == 0:
            raise ConfigError(f"{key} is true but needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)")
    if zero.compute_grad_norm is False and stage not in (1, 2):
        raise ConfigError(
            f"zero_optimization.compute_grad_norm is false, which only stage 1 or 2 supports "
            f"(zero_optimization.stage is {stage})"
        )
    if zero.compute_grad_norm is False:
        _check_no_grad_norm(cfg)
    if cfg.gradient_allreduce_op == "sum" and stage == 3:
        raise ConfigError('gradient_allreduce_op "sum" is not supported with zero_optimization.stage 3')
    _check_offload(cfg)


def _check_no_grad_norm(cfg: ZeroshardConfig) -> None:
    """DeepSpeed's stage 1-2 optimizer refuses compute_grad_norm=false with clipping or optimizer offload."""
    clipping = cfg.gradient_clipping
    if isinstance(clipping, float) and clipping > 0:
        raise ConfigError(
            f"zero_optimization.compute_grad_norm is false, which needs gradient_clipping 0 (gradient_clipping is "
            f"{clipping})"
        )
    device = cfg.zero_optimization.offload_optimizer.device
    if isinstance(device, str) and device != "none":
        raise ConfigError(
            f"zero_optimization.compute_grad_norm is false, which does not work with optimizer offload "
            f'(zero_optimization.offload_optimizer.device is "{device}")'
        )


def _check_offload(cfg: ZeroshardConfig) -> None:
    """Where zeroshard can offload: optimizer state at stages 1-3 (at stage 3 also a `ratio` of it on the host), and
    NVMe only with a path.
    offload_param below stage 3 is ignored with a warning, as DeepSpeed ignores it (`warn_ignored`)."""
    zero = cfg.zero_optimization
    stage = zero.stage
    optimizer_device = zero.offload_optimizer.device
    if isinstance(optimizer_device, str) and optimizer_device != "none" and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs zero_optimization.stage >= 1")
    # [Note: partial offload] in offload/tier.py: ratio < 1 splits stage 3's sub-groups between device and host
    ratio = zero.offload_optimizer.ratio
    if isinstance(ratio, float) and ratio != 1.0:
        needs = None
        if stage != 3:
            needs = f"zero_optimization.stage 3 (it is {stage})"
        elif optimizer_device != "cpu":
            needs = f'offload_optimizer.device "cpu" (it is "{optimizer_device}")'
        if needs is not None:
            raise ConfigError(
                f"zero_optimization.offload_optimizer.ratio: {ratio} (partial offload) needs {needs}; "
                "use ratio 1.0 or remove it"
            )
        if str(cfg.zeroshard.backend) == "fsdp2":
            raise ConfigError(
                f'zero_optimization.offload_optimizer.ratio: {ratio} (partial offload) needs the "zero" backend: '
                "FSDP2's CPUOffloadPolicy offloads all optimizer state or none"
            )
    _check_super_offload(cfg)
    for name in ("offload_param", "offload_optimizer") if stage == 3 else ("offload_optimizer",):
        offload = getattr(zero, name)
        if offload.device == "nvme" and not offload.nvme_path:
            raise ConfigError(f'zero_optimization.{name}.device is "nvme" but {name}.nvme_path is not set')


def _check_super_offload(cfg: ZeroshardConfig) -> None:
    """[Note: speculative host steps]: stage 3 with the optimizer on the host, and an Adam step it can undo."""
    zero = cfg.zero_optimization
    block = zero.offload_optimizer
    if block.super_offload is not True:
        return
    key = "zero_optimization.offload_optimizer.super_offload"
    needs = None
    if zero.stage != 3:
        needs = f"zero_optimization.stage 3 (it is {zero.stage})"
    elif block.device != "cpu":
        needs = f'offload_optimizer.device "cpu" (it is "{block.device}")'
    elif zero.offload_param.device == "nvme":
        needs = 'offload_param.device "none" or "cpu" (it is "nvme")'
    elif cfg.bf16.bf16_master_weights_and_grads is True:  # [Note: undoing an Adam step] is exact enough in fp32
        needs = "fp32 master weights (bf16.bf16_master_weights_and_grads is true)"
    elif cfg.fp16.fp16_master_weights_and_grads is True:
        needs = "fp32 master weights (fp16.fp16_master_weights_and_grads is true)"
    elif str(cfg.zeroshard.backend) == "fsdp2":
        needs = 'the "zero" backend (zeroshard.backend is "fsdp2")'
    elif cfg.managed_gradient_accumulation is False:  # it steps during the boundary's backward, which has none
        needs = "managed_gradient_accumulation true (it is false: only step() knows where a window ends)"
    elif isinstance(block.cpuadam_cores_perc, float) and block.cpuadam_cores_perc <= 0.0:
        needs = "offload_optimizer.cpuadam_cores_perc > 0 (it is 0)"
    if needs is not None:
        raise ConfigError(f"{key}: true needs {needs}; set super_offload false or remove it")
    optimizer = cfg.optimizer
    clipping = cfg.gradient_clipping
    if isinstance(clipping, int | float) and clipping > 0:
        return  # nothing is speculated, so nothing is undone (initialize warns)
    if optimizer is not None and isinstance(optimizer.type, str):
        amsgrad = isinstance(optimizer.params, dict) and bool(optimizer.params.get("amsgrad", False))
        if optimizer.type.lower() not in ("adam", "adamw") or amsgrad:
            raise ConfigError(
                f"{key}: true undoes a skipped step's updates, which zeroshard can for Adam and AdamW without amsgrad; "
                f"optimizer.type is {optimizer.type!r}{' with amsgrad' if amsgrad else ''}: use Adam/AdamW or set "
                "super_offload false"
            )


def warn_ignored(cfg: ZeroshardConfig, logger: logging.Logger) -> None:
    """One warning per key DeepSpeed accepts and ignores in this config, and so do we (`parse_config` calls it;
    `zeroshard validate-config` shows the same line)."""
    zero = cfg.zero_optimization
    device = zero.offload_param.device
    if isinstance(device, str) and device != "none" and zero.stage < 3:
        logger.warning(
            f'zeroshard: zero_optimization.offload_param.device="{device}" is ignored at zero_optimization.stage '
            f"{zero.stage}, as DeepSpeed ignores it: stages 0-2 keep whole parameters on every rank (offload_param "
            "needs stage 3; offload_optimizer offloads optimizer state at stages 1-2)"
        )
    buffer_dtype = cfg.data_types.buffer_dtype
    if isinstance(buffer_dtype, str) and cfg.fp16.enabled is False and cfg.bf16.enabled is False:
        logger.warning(
            f'zeroshard: data_types.buffer_dtype "{buffer_dtype}" is ignored in fp32 training, as DeepSpeed ignores '
            "it: buffers are cast only under bf16 or fp16"
        )
    if zero.parameter_alignment is True and zero.stage not in (1, 2):
        logger.warning(
            f"zeroshard: zero_optimization.parameter_alignment is ignored at zero_optimization.stage {zero.stage}, "
            "as DeepSpeed ignores it: it aligns the parameters of stage 1-2 flat buffers"
        )
    zeropp = zeropp_keys(zero)
    if zeropp and zero.stage < 3 and str(cfg.zeroshard.backend) != "fsdp2":  # fsdp2 refuses them (fsdp2/plan.py)
        logger.warning(
            f"zeroshard: zero_optimization.{', '.join(zeropp)} (ZeRO++) is ignored at zero_optimization.stage "
            f"{zero.stage}, as DeepSpeed ignores it: ZeRO++ works on stage 3's parameter shards and gathers and its "
            "gradient reduction"
        )


def zeropp_keys(zero: Any) -> list[str]:
    """The ZeRO++ keys a `zero_optimization` block turns on."""
    return [
        key
        for key, on in (
            ("zero_quantized_weights", zero.zero_quantized_weights is True),
            ("zero_hpz_partition_size", _int(zero.zero_hpz_partition_size) > 1),
            ("zero_quantized_gradients", zero.zero_quantized_gradients is True),
            ("zero_quantized_nontrainable_weights", zero.zero_quantized_nontrainable_weights is True),
        )
        if on
    ]


def _int(value: Any) -> int:
    """An int key's value, 1 while it is still "auto" (resolved to DeepSpeed's default, 1, by resolve_config)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 1
