"""`import zeroshard as deepspeed`: more names DeepSpeed's own tests import (the checkpointing module's globals under
both module paths, `get_accelerator` at the top, `utils.torch`), compared with DeepSpeed's where that is cheap."""

from __future__ import annotations

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed


def test_checkpointing_globals_read_and_write_the_settings():
    # [Note: checkpointing module globals]: DeepSpeed's tests save the globals, configure, and write them back
    import zeroshard as deepspeed
    from zeroshard.runtime.activation_checkpointing import checkpointing as by_path

    cp = deepspeed.checkpointing
    assert by_path is cp
    names = ("PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "num_layers", "CPU_CHECKPOINT", "SYNCHRONIZE")
    names += ("PROFILE_TIME", "mpu", "deepspeed_checkpointing_enabled")
    saved = {name: getattr(cp, name) for name in names}
    try:
        cp.configure(None, partition_activations=True, checkpoint_in_cpu=True, num_checkpoints=3)
        assert (cp.PARTITION_ACTIVATIONS, cp.CPU_CHECKPOINT, cp.num_layers) == (True, True, 3)
        assert cp.deepspeed_checkpointing_enabled
        cp.CPU_CHECKPOINT = False  # a write is the setting the next checkpoint uses
        assert cp.settings().cpu_checkpointing is False
        x = torch.randn(4, 8, requires_grad=True)
        cp.checkpoint(torch.nn.Linear(8, 8), x).sum().backward()
        assert cp.stats().peak_host_bytes == 0 and cp.stats().peak_device_bytes > 0
        cp.PARTITION_ACTIVATIONS, cp.CONTIGUOUS_CHECKPOINTING, cp.num_layers = False, True, None
        cp.checkpoint(torch.nn.Linear(8, 8), x).sum().backward()  # contiguous alone does nothing, as in DeepSpeed
    finally:
        for name, value in saved.items():
            setattr(cp, name, value)
        cp.reset()
    assert {name: getattr(cp, name) for name in names} == saved


def test_non_reentrant_checkpoint_under_deepspeeds_module_path():
    from zeroshard.checkpointing import non_reentrant_checkpoint
    from zeroshard.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint as by_path

    assert by_path is non_reentrant_checkpoint


def test_get_accelerator_at_the_top():
    import zeroshard as deepspeed
    from zeroshard.accelerator import get_accelerator

    assert deepspeed.get_accelerator is get_accelerator


RELEASE = torch.__version__.split("+")[0]  # the running release: "2.13.0+cpu" is above it, as DeepSpeed compares


@pytest.mark.parametrize(
    ("min_version", "max_version"),
    [(2.1, None), (None, 2.0), ("2.0", "99"), (99, None), (None, "2.6.0"), (None, RELEASE), (RELEASE, None)],
)
def test_required_torch_version_as_deepspeeds(min_version, max_version):
    from zeroshard.utils.torch import required_torch_version

    ours = required_torch_version(min_version=min_version, max_version=max_version)
    ds = import_deepspeed()
    from deepspeed.utils.torch import required_torch_version as theirs  # noqa: E402 - after the reference's import

    assert ds is not None and ours == theirs(min_version=min_version, max_version=max_version)


def test_register_grad_hook_runs_after_accumulation():
    from zeroshard.utils.torch import register_grad_hook

    seen = []
    p = torch.nn.Parameter(torch.ones(3))
    register_grad_hook(p, lambda param: seen.append(param.grad.clone()))
    (p * 2).sum().backward()
    assert torch.equal(seen[0], torch.full((3,), 2.0))


def test_runtime_utils_partitioning_and_weight_norm_as_deepspeeds():
    import_deepspeed()
    from deepspeed.runtime import utils as theirs

    from zeroshard.runtime import utils as ours

    for items, parts in [(10, 3), (3, 5), (12, 4), (7, 7)]:
        assert ours.partition_uniform(items, parts) == theirs.partition_uniform(items, parts)
    for weights, parts in [([1, 2, 3, 4], 2), ([5, 1, 1, 1, 1, 5], 3), ([2] * 9, 4)]:
        assert ours.partition_balanced(weights, parts) == theirs.partition_balanced(weights, parts)
        assert ours.prefix_sum_inc(weights) == theirs.prefix_sum_inc(weights)
    torch.manual_seed(0)
    params = [torch.randn(4, 3), torch.randn(5)]
    for norm_type in (2, 1, float("inf")):
        assert ours.get_weight_norm(params, norm_type) == pytest.approx(theirs.get_weight_norm(params, norm_type))
    broken = [torch.tensor([1.0, float("nan")])]
    assert ours.get_weight_norm(broken) == theirs.get_weight_norm(broken) == -1


def test_csv_monitor_under_deepspeeds_class_name():
    from zeroshard.monitor.csv_monitor import CSVMonitor, csvMonitor

    assert csvMonitor is CSVMonitor


def test_expert_parallel_rank_layout_as_deepspeeds():
    import_deepspeed()
    from deepspeed.utils.groups import _get_expert_parallel_ranks as theirs

    from zeroshard.utils.groups import _get_expert_parallel_ranks as ours

    for world in (1, 2, 4, 8, 16):
        for tp in (1, 2, 4):
            for pp in (1, 2):
                for ep in (1, 2, 4):
                    for data_first in (False, True):
                        if world % (tp * pp) or (world // (tp * pp)) % ep:
                            with pytest.raises(ValueError, match="do not split"):
                                ours(world, tp, ep, pp, data_first)
                            continue
                        assert ours(world, tp, ep, pp, data_first) == theirs(world, tp, ep, pp, data_first)


@pytest.mark.parametrize(
    ("module", "names"),
    [("data_sampling", "data-efficiency sampler"), ("data_routing", "random-LTD"), ("data_sampling.data_sampler", "")],
)
def test_data_efficiency_modules_say_they_are_not_provided(module, names):
    # DeepSpeedExamples' data_efficiency scripts import these: one line naming what is missing and what to use
    import importlib

    with pytest.raises(ModuleNotFoundError, match=f"{names}.*is not provided by zeroshard"):
        importlib.import_module(f"zeroshard.runtime.data_pipeline.{module}")


@pytest.mark.parametrize(
    ("stage", "precision", "optimizer", "expected"),
    [
        (0, "fp16", "Adam", "zeroshard.runtime.fp16.fused_optimizer.FP16_Optimizer"),
        (0, "fp16", "Lamb", "zeroshard.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"),
        (0, "bf16", "Adam", "zeroshard.runtime.fp16.fused_optimizer.FP16_Optimizer"),  # DeepSpeed's DDP_BFLOAT16
        (0, "bf16", "SGD", "zeroshard.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"),
        (1, "fp32", "Adam", "zeroshard.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"),
        (1, "bf16-fp32-accumulation", "Adam", "zeroshard.runtime.bf16_optimizer.BF16_Optimizer"),
        (2, "bf16", "Adam", "zeroshard.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"),
        (3, "fp32", "Adam", "zeroshard.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"),
    ],
)
def test_engine_and_optimizer_classes_under_deepspeeds_module_paths(stage, precision, optimizer, expected):
    """Scripts test `isinstance(model, DeepSpeedEngine)` and `isinstance(engine.optimizer, <DeepSpeed's class>)`
    with the classes imported from DeepSpeed's modules: the class DeepSpeed 0.19.8's engine makes for the config."""
    import importlib

    import torch.distributed as dist

    import zeroshard
    from zeroshard.runtime.engine import DeepSpeedEngine

    module, name = expected.rsplit(".", 1)
    named = getattr(importlib.import_module(module), name)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": precision == "fp16"},
        "bf16": {"enabled": precision.startswith("bf16")},
    }
    if precision == "bf16-fp32-accumulation":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, optim, _, _ = zeroshard.initialize(model=torch.nn.Linear(2, 2), config=config)
    try:
        assert isinstance(engine, DeepSpeedEngine) and optim is engine.optimizer
        assert isinstance(optim, named) and type(optim).__name__ == name, type(optim)
    finally:
        engine.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_zero_stage_enum_and_loss_scalers_for_safe_globals_as_deepspeeds():
    """Scripts allow-list DeepSpeed's `LossScaler` and `ZeroStageEnum` for `torch.load(weights_only=True)`."""
    from zeroshard.precision.loss_scaler import DynamicLossScaler as Ours
    from zeroshard.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from zeroshard.runtime.zero.config import ZeroStageEnum

    theirs = import_deepspeed("deepspeed.runtime.zero.config").ZeroStageEnum
    assert [(m.name, m.value) for m in ZeroStageEnum] == [(m.name, m.value) for m in theirs]
    assert ZeroStageEnum.max_stage is ZeroStageEnum.weights and ZeroStageEnum(2) == 2
    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum])
    assert LossScaler(8.0).loss_scale == 8.0 and DynamicLossScaler is Ours


def test_is_model_parallel_parameter_reads_megatrons_marks_as_deepspeeds():
    from zeroshard.runtime.utils import is_model_parallel_parameter

    theirs = import_deepspeed("deepspeed.runtime.utils").is_model_parallel_parameter
    for marks in ({}, {"model_parallel": True}, {"tensor_model_parallel": True}, {"tensor_model_parallel": False}):
        param = torch.nn.Parameter(torch.ones(1))
        for name, value in marks.items():
            setattr(param, name, value)
        assert is_model_parallel_parameter(param) == theirs(param), marks


def test_topology_str_prime_factors_and_range_lists_as_deepspeeds():
    from zeroshard.runtime.pipe.topology import ProcessTopology, _prime_factors
    from zeroshard.utils.numa import parse_range_list

    topology = import_deepspeed("deepspeed.runtime.pipe.topology")
    numa = import_deepspeed("deepspeed.utils.numa")
    assert str(ProcessTopology(["pipe", "data"], [2, 3])) == str(topology.ProcessTopology(["pipe", "data"], [2, 3]))
    for n in (1, 2, 12, 97, 360, 1024):
        assert _prime_factors(n) == topology._prime_factors(n), n
    assert parse_range_list("0,2-4,6") == numa.parse_range_list("0,2-4,6") == [0, 2, 3, 4, 6]
    for bad in ("3,1", "0-2,2"):
        with pytest.raises(ValueError):
            parse_range_list(bad)
        with pytest.raises(ValueError):
            numa.parse_range_list(bad)
