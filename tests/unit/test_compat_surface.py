"""`import zeroshard as deepspeed`: the public names DeepSpeed scripts use, compared with DeepSpeed's own where
that is cheap. No process group: the names that need one are tested in tests/distributed/test_compat_engine.py."""

from __future__ import annotations

import argparse
import inspect
import logging
from importlib import import_module

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed


def _arguments(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    return {a.dest: (tuple(a.option_strings), a.default, a.type, a.nargs, a.const) for a in parser._actions}


def test_add_config_arguments_matches_deepspeed():
    import zeroshard

    ds = import_deepspeed()
    ours = zeroshard.add_config_arguments(argparse.ArgumentParser())
    theirs = ds.add_config_arguments(argparse.ArgumentParser())
    assert _arguments(ours) == _arguments(theirs)
    argv = ["--deepspeed", "--deepspeed_config", "ds.json", "--deepscale", "--deepscale_config", "old.json"]
    assert vars(ours.parse_args(argv)) == vars(theirs.parse_args(argv))
    assert vars(ours.parse_args([])) == vars(theirs.parse_args([]))


def test_init_distributed_takes_deepspeeds_arguments():
    import zeroshard

    ds = import_deepspeed()
    ours = inspect.signature(zeroshard.init_distributed).parameters
    theirs = inspect.signature(ds.init_distributed).parameters
    assert list(ours) == list(theirs)
    for name in ("dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "init_method", "rank"):
        assert ours[name].default == theirs[name].default, name


def test_init_distributed_not_required_where_nothing_started_is_refused():
    """DeepSpeed asserts the group was started; it returned with nothing started, and `initialize` (whose
    dist_init_required was ignored) started one."""
    import torch.distributed as dist

    import zeroshard

    for call in (
        lambda: zeroshard.init_distributed(dist_init_required=False),
        lambda: zeroshard.initialize(
            model=torch.nn.Linear(2, 2), config={"train_batch_size": 1}, dist_init_required=False
        ),
    ):
        with pytest.raises(zeroshard.ZeroshardError, match="dist_init_required=False, but torch.distributed is not"):
            call()
        assert not dist.is_initialized()


def test_cpu_accelerator_answers_as_deepspeeds():
    from zeroshard.accelerator import Accelerator, get_accelerator

    ds_acc = import_deepspeed("deepspeed.accelerator").get_accelerator()
    assert ds_acc.device_name() == "cpu", "the test runs with DS_ACCELERATOR=cpu"
    ours = Accelerator("cpu")
    for name in (
        "device_name",
        "current_device_name",
        "communication_backend_name",
        "is_available",
        "is_bf16_supported",
        "is_fp16_supported",
        "is_synchronized_device",
        "get_compile_backend",
    ):
        mine, theirs = getattr(ours, name)(), getattr(ds_acc, name)()
        if isinstance(mine, bool):
            theirs = bool(theirs)  # DeepSpeed's CPU is_fp16_supported returns None where oneDNN lacks fp16
        assert mine == theirs, name
    assert ours.Stream is None and ours.Event is None and ds_acc.Stream is None and ds_acc.Event is None
    t = torch.ones(2)
    assert ours.on_accelerator(t) and ours.pin_memory(t) is t
    assert ours.memory_allocated() > 0 and ours.max_memory_allocated() >= ours.memory_allocated()
    assert (get_accelerator() is get_accelerator()) and isinstance(get_accelerator(), Accelerator)
    ours.set_compile_backend("aot_eager")
    assert ours.get_compile_backend() == "aot_eager"
    with pytest.raises(ValueError, match="not a torch.compile backend"):
        ours.set_compile_backend("no_such_backend")


def test_accelerator_methods_exist_in_deepspeed():
    from zeroshard.accelerator import Accelerator

    ds_acc = import_deepspeed("deepspeed.accelerator").get_accelerator()
    public = [name for name in dir(Accelerator) if not name.startswith("_")]
    assert [name for name in public if not hasattr(ds_acc, name)] == []


def test_cpu_accelerator_seeds_and_names_devices():
    from zeroshard.accelerator import Accelerator

    acc = Accelerator("cpu")
    acc.manual_seed(7)
    a = torch.rand(3)
    acc.manual_seed_all(7)
    assert torch.equal(a, torch.rand(3))
    assert acc.device_name(1) == "cpu" and Accelerator("cuda").device_name(1) == "cuda:1"
    assert Accelerator("cuda").communication_backend_name() == "nccl"
    with pytest.raises(ValueError):
        Accelerator("xpu")


def test_comm_names_are_deepspeeds(monkeypatch):
    import zeroshard.comm as comm
    from zeroshard.comm.api import __all__ as names

    ds_comm = import_deepspeed("deepspeed.comm")
    assert [name for name in names if not hasattr(ds_comm, name)] == []
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert comm.get_local_rank() == 3
    assert comm.get_global_rank(None, 5) == 5
    assert comm.ReduceOp.SUM == torch.distributed.ReduceOp.SUM
    assert comm.log_summary() is None and comm.log_summary(return_dict=True) == {}
    assert not comm.is_initialized()


def test_utils_logger_log_dist_and_groups():
    from zeroshard.utils import RepeatingLoader, groups, log_dist, logger
    from zeroshard.utils.logging import logger as same_logger

    assert logger is same_logger
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        log_dist("hello", ranks=[0])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # DeepSpeed logs on every process before torch.distributed is initialised, with rank -1.
    assert [r.getMessage() for r in records] == ["[Rank -1] hello"]
    assert (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()) == (1, 0)
    assert groups.get_data_parallel_group() is None and groups._get_model_parallel_world_size() == 1
    it = RepeatingLoader([1, 2, 3])
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_fused_adam_builds_what_the_config_builds_with_deepspeeds_defaults():
    from zeroshard.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zeroshard.optim import build_optimizer

    ds_adam = import_deepspeed("deepspeed.ops.adam")
    for ours, theirs in ((FusedAdam, ds_adam.FusedAdam), (DeepSpeedCPUAdam, ds_adam.DeepSpeedCPUAdam)):
        mine = {k: p.default for k, p in inspect.signature(ours).parameters.items()}
        ref = {k: p.default for k, p in inspect.signature(theirs.__init__).parameters.items() if k != "self"}
        assert mine == ref, ours.__name__
    w = torch.zeros(4, requires_grad=True)
    opt = FusedAdam([w], lr=1e-4, weight_decay=0.1)
    expected = build_optimizer("Adam", {"lr": 1e-4, "weight_decay": 0.1}, [{"params": [w]}])
    assert type(opt) is type(expected) is torch.optim.AdamW
    assert opt.defaults == expected.defaults and opt.param_groups[0]["params"] == [w]
    assert type(FusedAdam([w], adam_w_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam([{"params": [w], "lr": 0.5}], adamw_mode=False)) is torch.optim.Adam
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([w], amsgrad=True)
    from zeroshard.optim.adam import UncorrectedAdam

    uncorrected = DeepSpeedCPUAdam([w], bias_correction=False, adamw_mode=False)
    assert type(uncorrected) is UncorrectedAdam and uncorrected.defaults["adam_w_mode"] is False
    assert type(FusedAdam([w], bias_correction=False)) is UncorrectedAdam
    # classes, as DeepSpeed's: isinstance holds for what each builds and for what a config DeepSpeed builds it for
    # builds ([Note: DeepSpeed's optimizer classes]); it raised TypeError (they were functions)
    assert isinstance(opt, FusedAdam) and not isinstance(opt, DeepSpeedCPUAdam)
    assert isinstance(DeepSpeedCPUAdam([w]), DeepSpeedCPUAdam) and not isinstance(DeepSpeedCPUAdam([w]), FusedAdam)
    assert isinstance(expected, FusedAdam) and not isinstance(torch.optim.AdamW([w]), FusedAdam)
    assert not isinstance(build_optimizer("Adam", {"torch_adam": True}, [{"params": [w]}]), FusedAdam)
    with pytest.raises(TypeError, match=r"class MyAdam\(FusedAdam\): FusedAdam builds a torch optimizer"):
        type("MyAdam", (FusedAdam,), {})  # its __init__ would never run: refused where it is written


def test_fused_lamb_is_zeroshards_lamb_with_deepspeeds_signature():
    from zeroshard.errors import ConfigError
    from zeroshard.ops.lamb import FusedLamb
    from zeroshard.optim.lamb import Lamb

    w = torch.zeros(2, requires_grad=True)
    opt = FusedLamb([w], 1e-3, True, (0.9, 0.99), 1e-6, False, 0.01, 0.0, 0.5, 0.02)
    assert type(opt) is Lamb and isinstance(opt, FusedLamb) and not isinstance(Lamb([w]), FusedLamb)
    assert (
        opt.defaults["max_coeff"] == 0.5 and opt.defaults["min_coeff"] == 0.02 and opt.defaults["betas"] == (0.9, 0.99)
    )
    with pytest.raises(ConfigError, match="gradient_clipping"):
        FusedLamb([w], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="AMSGrad"):
        FusedLamb([w], amsgrad=True)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 5}),
        ("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 0.1, "warmup_num_steps": 3}),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3}),
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}),
        ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2}),
    ],
)
def test_lr_schedules_follow_deepspeeds(name, params):
    from zeroshard.runtime import lr_schedules

    ds_schedules = import_deepspeed("deepspeed.runtime.lr_schedules")

    def lrs(factory):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)
        sched = factory(opt, **params)
        seen = []
        for _ in range(8):
            sched.step()
            seen.append(opt.param_groups[0]["lr"])
        return seen

    assert lrs(getattr(lr_schedules, name)) == pytest.approx(lrs(getattr(ds_schedules, name)), rel=1e-12)
    assert lr_schedules.VALID_LR_SCHEDULES == ds_schedules.VALID_LR_SCHEDULES
    ours = inspect.signature(getattr(lr_schedules, name)).parameters
    theirs = inspect.signature(getattr(ds_schedules, name)).parameters
    assert list(ours) == list(theirs)  # positional calls mean the same
    assert {k: p.default for k, p in ours.items() if k != "warmup_max_lr"} == {
        k: p.default for k, p in theirs.items() if k != "warmup_max_lr"
    }


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
def test_config_scheduler_is_an_instance_of_the_lr_schedules_class(name):
    from zeroshard.optim import build_lr_scheduler
    from zeroshard.runtime import lr_schedules

    params = {"WarmupDecayLR": {"total_num_steps": 2000}, "WarmupCosineLR": {"total_num_steps": 2000}}.get(name, {})
    if name == "OneCycle":
        params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.05)
    assert isinstance(build_lr_scheduler(name, params, opt), getattr(lr_schedules, name))
    assert getattr(lr_schedules, name) is getattr(import_module("zeroshard.optim.schedulers"), name)


def test_runtime_config_constants_equal_deepspeeds():
    from zeroshard.runtime import config

    ds_config = import_deepspeed("deepspeed.runtime.config")
    assert "LAMB_OPTIMIZER" in config.__all__ and "TRAIN_BATCH_SIZE" in config.__all__
    for name in config.__all__:
        if name == "DeepSpeedConfig":  # a class (tests/unit/test_ds_config_class.py), not a constant
            continue
        theirs = getattr(ds_config, name)
        assert getattr(config, name) == (tuple(theirs) if isinstance(theirs, list) else theirs), name


def test_runtime_constants_equal_deepspeeds():
    from zeroshard.runtime import constants

    ds_constants = import_deepspeed("deepspeed.runtime.constants")
    names = [name for name in dir(constants) if name.isupper()]
    assert names and {name: getattr(constants, name) for name in names} == {
        name: getattr(ds_constants, name) for name in names
    }


def test_set_random_seed_and_see_memory_usage():
    from zeroshard.runtime.utils import see_memory_usage, set_random_seed

    set_random_seed(3)
    a = torch.rand(2)
    set_random_seed(3)
    assert torch.equal(a, torch.rand(2))
    see_memory_usage("not forced")  # returns without touching the accelerator
    see_memory_usage("forced", force=True)


def test_zero_init_builds_on_meta_and_takes_deepspeeds_arguments():
    import torch.distributed as dist

    import zeroshard

    started = not dist.is_initialized()
    timeout = {"zeroshard": {"collective_timeout_s": 42}}  # the group it starts has the config's deadline
    with zeroshard.zero.Init(remote_device="cpu", pin_memory=True, dtype=torch.bfloat16, config_dict_or_path=timeout):
        built = torch.nn.Linear(2, 2)
    assert built.weight.device.type == "meta"
    assert dist.is_initialized() and dist.get_world_size() == 1  # started by it, as DeepSpeed's
    if started:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 42
    with zeroshard.zero.Init(enabled=False):
        plain = torch.nn.Linear(2, 2)
    assert plain.weight.device.type == "cpu"
    with zeroshard.zero.Init(module=plain):
        assert torch.empty(1).device.type == "cpu"
    with pytest.raises(zeroshard.ConfigError, match="mpu"):
        zeroshard.zero.Init(mpu=object())
    assert zeroshard.zero.GatheredParameters is zeroshard.GatheredParameters
    if started:  # the other tests of this process find none, as before
        dist.destroy_process_group()


def test_register_external_parameter():
    import zeroshard

    owner, user = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    zeroshard.zero.register_external_parameter(owner, owner.weight)  # its own: gathered with its unit
    with pytest.raises(NotImplementedError, match="GatheredParameters"):
        zeroshard.zero.register_external_parameter(user, owner.weight)


@pytest.mark.parametrize("name", ["PipelineModule", "LayerSpec", "TiedLayerSpec"])
def test_pipe_takes_deepspeeds_arguments(name):
    """`deepspeed.pipe`'s classes take the same arguments, in the same order (behaviour: tests/distributed/
    test_pipeline.py and the compat script tests/compat/scripts/pipeline_train.py)."""
    import zeroshard.pipe

    theirs = getattr(import_deepspeed("deepspeed.pipe"), name)
    ours = getattr(zeroshard.pipe, name)
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)


@pytest.mark.parametrize("name", ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state"])
def test_safe_get_full_takes_deepspeeds_arguments(name):
    """DeepSpeed's signatures; a parameter no engine trains gives None (its `.grad` for the gradient), as in
    DeepSpeed. The values are tested on 2 ranks at every stage: tests/distributed/test_compat_engine.py."""
    import zeroshard.utils

    ds_utils = import_deepspeed("deepspeed.utils")
    ours, theirs = getattr(zeroshard.utils, name), getattr(ds_utils, name)
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
    stranger = torch.nn.Parameter(torch.zeros(1))
    args = [stranger] + (["exp_avg"] if name.endswith("state") else [])
    assert ours(*args) is None and theirs(*args) is None
    stranger.grad = torch.ones(1)
    if name == "safe_get_full_grad":
        assert ours(stranger) is stranger.grad and theirs(stranger) is stranger.grad


@pytest.mark.parametrize("name", ["safe_set_full_fp32_param", "safe_set_full_optimizer_state"])
def test_safe_set_full_takes_deepspeeds_arguments(name):
    import zeroshard.utils

    ds_utils = import_deepspeed("deepspeed.utils")
    ours, theirs = getattr(zeroshard.utils, name), getattr(ds_utils, name)
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
    stranger = torch.nn.Parameter(torch.zeros(2))
    args = [stranger, torch.ones(2)] + (["exp_avg"] if name.endswith("state") else [])
    ours(*args)  # a parameter no engine trains is left alone, as in DeepSpeed
    theirs(*args)
    assert torch.equal(stranger, torch.zeros(2))


def test_safe_set_full_grad_and_the_vectorized_update_take_deepspeeds_arguments():
    """A parameter no engine trains: its `.grad` is set (or updated), none is made, as in DeepSpeed."""
    import zeroshard.utils

    ds_utils = import_deepspeed("deepspeed.utils")
    for name in ("safe_set_full_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized"):
        ours, theirs = getattr(zeroshard.utils, name), getattr(ds_utils, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    for lib in (zeroshard.utils, ds_utils):
        stranger = torch.nn.Parameter(torch.zeros(2))
        lib.safe_set_full_grad(stranger, torch.ones(2))
        assert stranger.grad is None
        stranger.grad = torch.zeros(2)
        lib.safe_set_full_grad(stranger, torch.full((2,), 3.0))
        lib.safe_update_full_grad_vectorized([stranger], lambda grad, param: grad * 2)
        assert torch.equal(stranger.grad, torch.full((2,), 6.0)), lib


def test_initialize_reads_the_deprecated_deepscale_config_and_refuses_two_configs(tmp_path):
    """As DeepSpeed: `--deepscale_config` still names the config; a config both in args and config= is refused."""
    import argparse

    import zeroshard
    from zeroshard.errors import ConfigError

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1}')
    args = zeroshard.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepscale_config", str(path)])
    with pytest.raises(ConfigError, match="both from args .* and from config="):
        zeroshard.initialize(args=args, model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1})


def test_deepspeeds_top_level_class_names_are_zeroshards():
    """`isinstance(model, deepspeed.DeepSpeedEngine)` and friends hold for what zeroshard builds."""
    import zeroshard
    from zeroshard.engine import Engine
    from zeroshard.hybrid_engine import HybridEngine
    from zeroshard.pipe import PipelineModule
    from zeroshard.pipe.engine import PipelineEngine

    assert zeroshard.DeepSpeedEngine is Engine and issubclass(zeroshard.DeepSpeedHybridEngine, Engine)
    assert zeroshard.DeepSpeedHybridEngine is HybridEngine and issubclass(zeroshard.PipelineEngine, Engine)
    assert zeroshard.PipelineEngine is PipelineEngine and zeroshard.PipelineModule is PipelineModule
    assert zeroshard.DeepSpeedConfigError is zeroshard.ConfigError
    assert zeroshard.log_dist is zeroshard.utils.log_dist and zeroshard.logger is zeroshard.utils.logger
    deepspeed = import_deepspeed()
    for name in ("DeepSpeedEngine", "DeepSpeedHybridEngine", "PipelineEngine", "PipelineModule", "log_dist"):
        assert hasattr(deepspeed, name), name


def test_zero_to_fp32_takes_deepspeeds_arguments():
    """`deepspeed.utils.zero_to_fp32`'s functions, `lazy_mode` and `to_torch_tensor` included (values:
    tests/distributed/test_checkpoint.py)."""
    import zeroshard.utils.zero_to_fp32 as ours

    theirs = import_deepspeed("deepspeed.utils.zero_to_fp32")
    for name in (
        "get_fp32_state_dict_from_zero_checkpoint",
        "convert_zero_checkpoint_to_fp32_state_dict",
        "convert_zero_checkpoint_to_state_dict",
        "load_state_dict_from_zero_checkpoint",
        "to_torch_tensor",
    ):
        mine, reference = getattr(ours, name), getattr(theirs, name)
        assert list(inspect.signature(mine).parameters) == list(inspect.signature(reference).parameters), name


def test_version_attributes_are_deepspeeds():
    """`deepspeed.__version_major__` and friends (DeepSpeed's TestBasicConfig reads them): zeroshard's own version."""
    import zeroshard

    assert (zeroshard.__version_major__, zeroshard.__version_minor__, zeroshard.__version_patch__) == tuple(
        int(part) for part in zeroshard.__version__.split(".")
    )
    ds = import_deepspeed("deepspeed")
    assert isinstance(ds.__git_hash__, str) and zeroshard.__git_hash__ == zeroshard.__git_branch__ == "[none]"


def test_compression_helper_gets_and_sets_by_dotted_name_as_deepspeeds():
    """DeepSpeed-Chat's LoRA code imports these from `deepspeed.compression.helper` (the module was missing)."""
    from zeroshard.compression.helper import recursive_getattr, recursive_setattr

    ds_helper = import_deepspeed("deepspeed.compression.helper")
    for get, put in (
        (recursive_getattr, recursive_setattr),
        (ds_helper.recursive_getattr, ds_helper.recursive_setattr),
    ):
        net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        assert get(net, "0.0.weight") is net[0][0].weight
        put(net, "0.0", torch.nn.Identity())
        put(net, "extra", torch.nn.ReLU())
        assert isinstance(net[0][0], torch.nn.Identity) and isinstance(get(net, "extra"), torch.nn.ReLU)


def test_runtime_pipe_module_paths_hold_the_pipeline_names():
    """Megatron-DeepSpeed, GPT-NeoX and DeepSpeed's tests import them from `deepspeed.runtime.pipe.*` (missing)."""
    import zeroshard
    from zeroshard import pipe
    from zeroshard.pipe.engine import PipelineEngine
    from zeroshard.runtime.pipe import engine, module, topology

    ds_pipe = import_deepspeed("deepspeed.runtime.pipe")
    for name in ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"):
        assert getattr(zeroshard.runtime.pipe, name) is getattr(pipe, name) and hasattr(ds_pipe, name), name
    for name in ("ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"):
        assert getattr(topology, name) is getattr(pipe, name), name
    assert module.PipelineModule is pipe.PipelineModule and engine.PipelineEngine is PipelineEngine


def test_transformers_zero3_loading_finds_the_partition_parameters_names(monkeypatch):
    """`from_pretrained`/`from_config` under HfDeepSpeedConfig enter transformers' `prevent_arange_dtype_change`, which
    swaps `zero_wrapper_for_fp_tensor_constructor` (and compares with `_orig_torch_arange`): an AttributeError stopped
    DeepSpeed-Chat's ZeRO-3 model building under the swapped import; the wrapper is DeepSpeed's."""
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    from zeroshard.runtime.zero import partition_parameters as ours

    ds_pp = import_deepspeed("deepspeed.runtime.zero.partition_parameters")
    for pp in (ours, ds_pp):
        made = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, torch.device("cpu"))(3)
        assert made.dtype == torch.bfloat16 and made.tolist() == [1.0, 1.0, 1.0]
        assert pp.zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.bfloat16, None)(3).dtype == torch.int64
    monkeypatch.setattr(import_deepspeed("deepspeed.runtime.zero"), "partition_parameters", ours)
    monkeypatch.setenv("LOCAL_RANK", "0")  # (without target_device the wrapper asks get_accelerator for the device)
    original = ours.zero_wrapper_for_fp_tensor_constructor
    with prevent_arange_dtype_change():
        swapped = ours.zero_wrapper_for_fp_tensor_constructor
        assert swapped is not original and swapped(torch.arange, torch.bfloat16)(4.0).dtype == torch.float32
        made = swapped(torch.arange, torch.bfloat16, target_device=torch.device("cpu"))(4.0)
        assert made.dtype == torch.float32 and made.device.type == "cpu"
    assert ours.zero_wrapper_for_fp_tensor_constructor is original
