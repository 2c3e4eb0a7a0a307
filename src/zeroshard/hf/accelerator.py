"""`Accelerator`: an Accelerate script written for DeepSpeed, trained by the zeroshard engine.

[Note: Accelerate's DeepSpeed path on zeroshard]
A script run with `accelerate launch --config_file ...` (DeepSpeed selected) or given `Accelerator(deepspeed_plugin=
DeepSpeedPlugin(hf_ds_config=...))` takes accelerate's DeepSpeed branches everywhere: `accelerator.distributed_type`
is `DEEPSPEED`, `state.deepspeed_plugin.deepspeed_config` is the ds_config the script inspects (e.g. to choose
`DummyOptim`), `prepare` builds an engine, `backward` runs it, `save_state`/`load_state` call the engine's
`save_checkpoint`/`load_checkpoint` under the tag "pytorch_model". This subclass keeps all of that and changes two
things:

- the process group starts as for a plain multi-process run (accelerate's DeepSpeed mode would start it through
  `deepspeed.comm`), after which the shared `AcceleratorState` is told it is in DeepSpeed mode with the plugin
  active. The plugin is not "selected" the DeepSpeed way: that would register the config with transformers, whose
  `from_pretrained` would then build models under `deepspeed.zero.Init` (build under `zeroshard.zero_init()` to
  shard while loading; otherwise the model is sharded at `prepare`).
- `_prepare_deepspeed` fills the config's "auto" values by accelerate's rules (the plugin's own `fill_match` /
  `deepspeed_config_process`: micro batch from the data loaders, accumulation, clipping 1.0, the hidden-size
  buckets, `DummyOptim`'s lr and weight decay, `DummyScheduler`'s warmup and total steps divided by the process
  count) and calls `zeroshard.initialize` where accelerate calls `deepspeed.initialize`.

accelerate defines `DummyOptim`, `DummyScheduler` and its DeepSpeed wrappers in `accelerate.utils.deepspeed` but
re-exports them (to `accelerate.utils`, and to its accelerator module, whose `save_state`/`load_state` name them)
only when DeepSpeed is importable; without DeepSpeed this module binds the same classes under those names at import
(names that exist are left alone), so the script and accelerate's DeepSpeed paths run as with it.

The engine receives what DeepSpeed's would: `set_gradient_accumulation_boundary(accelerator.sync_gradients)`,
`backward(loss)` (the engine divides by the accumulation steps), `step()` on the boundary; the returned
optimizer's and config scheduler's `step`/`zero_grad` are accelerate's no-op wrappers, and a scheduler the script
built itself is accelerate's `AcceleratedScheduler`, stepped by the script. `get_state_dict` consolidates the
weights in the compute dtype at stage 3 (with `stage3_gather_16bit_weights_on_model_save`, as DeepSpeed).
`parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=P, ...)` (ALST) is taken as accelerate's
DeepSpeed mode takes it: the attention is wrapped (`UlyssesSPAttentionHF`, its groups handed to the engine) and the
prepared loaders yield sequence parts (`UlyssesSPDataLoaderAdapter`); the script combines the parts' losses over
`groups._get_sequence_parallel_group()`, as under DeepSpeed. Not supported, refused in one line: the other
`parallelism_config` sizes, `tensor_parallel.autotp_size` > 1 (accelerate's tensor-parallel mesh), fp8 (MS-AMP).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import accelerate
import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from accelerate.utils.dataclasses import DeepSpeedPlugin, get_module_class_from_name
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler
from accelerate.utils.other import compile_regions_deepspeed
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.engine import Engine
from zeroshard.engine_optimizer import ScriptOptimizer
from zeroshard.errors import ConfigError
from zeroshard.hf.arguments import launched_with_deepspeed
from zeroshard.hf.auto import hidden_size
from zeroshard.hf.link import engine_state_dict
from zeroshard.hf.ulysses import adapt_dataloader, register
from zeroshard.initialize import initialize
from zeroshard.runtime.lr_schedules import VALID_LR_SCHEDULES
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
# accelerate defines these in accelerate.utils.deepspeed and re-exports them (to accelerate.utils and its
# accelerator module) only when DeepSpeed is importable; its DeepSpeed paths (save_state, load_state) and scripts
# written for them use those names ([Note: Accelerate's DeepSpeed path on zeroshard])
_DEEPSPEED_NAMES = (
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
)
_HIDDEN_SIZE_KEYS = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` whose DeepSpeed mode runs on zeroshard ([Note: Accelerate's DeepSpeed path on
    zeroshard]); without a DeepSpeed plugin (argument or `accelerate launch` environment) it is accelerate's own.

    Example:
        >>> from zeroshard.hf import Accelerator  # was: from accelerate import Accelerator  # doctest: +SKIP
        >>> accelerator = Accelerator(gradient_accumulation_steps=2)  # doctest: +SKIP
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, deepspeed_plugin: Any = None, deepspeed_plugins: Any = None, **kwargs: Any):
        if deepspeed_plugin is not None and deepspeed_plugins is not None:
            raise ValueError("You cannot pass in both `deepspeed_plugin` and `deepspeed_plugins`.")  # accelerate's
        given = deepspeed_plugin if deepspeed_plugin is not None else deepspeed_plugins
        plugin = _one_plugin(given)
        if plugin is None:
            super().__init__(*args, **kwargs)
            return
        mixed_precision = kwargs.pop("mixed_precision", None)
        parallelism = _ulysses_only(kwargs.pop("parallelism_config", None))  # accelerate's DeepSpeed mode keeps it
        if not torch.accelerator.is_available():  # accelerate's multi-process CPU mode (gloo); its DeepSpeed mode
            kwargs["cpu"] = True  # would count one process on a machine without an accelerator
        with _deepspeed_hidden():
            super().__init__(*args, mixed_precision="no", **kwargs)
        os.environ[_USE_DEEPSPEED] = "true"  # as accelerate leaves it, for code that reads it later
        state = self.state
        if state.distributed_type != DistributedType.DEEPSPEED:  # the first Accelerator of the process
            requested = mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            plugin.set_mixed_precision(str(requested).lower())
            plugin._set_selected(True)  # active, without registering the config with transformers
            # both shared states, as accelerate's DeepSpeed mode sets them (each AcceleratorState() copies
            # PartialState's fields into its own)
            PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
            state.distributed_type = DistributedType.DEEPSPEED
            state.deepspeed_plugins = given if isinstance(given, dict) else plugin  # a dict stays one, by name
            state.parallelism_config = parallelism
        self.native_amp = False  # the engine's config sets the precision, as under DeepSpeed
        self.deepspeed_engine_wrapped: EngineWrapper | None = None

    # -- prepare ----------------------------------------------------------------------------------------
    def _prepare_deepspeed(self, *args: Any) -> tuple[Any, ...]:
        plugin = self.deepspeed_plugin
        self._refuse_unsupported(plugin)
        loaders = [obj for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
        result = [self._prepare_one(obj, first_pass=True) if obj in loaders else obj for obj in args]
        model = next((obj for obj in result if isinstance(obj, torch.nn.Module)), None)
        optimizer = next((obj for obj in result if isinstance(obj, (torch.optim.Optimizer, DummyOptim))), None)
        scheduler = next((obj for obj in result if _is_scheduler(obj)), None)
        micro_batch = self._micro_batch(plugin, loaders)
        sp = self.parallelism_config.sp_size if self.parallelism_config is not None else 1
        ours = self.gradient_state.num_steps  # accelerate's gradient_accumulation_steps
        plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=ours)
        if plugin.get_value("gradient_accumulation_steps") != ours:  # the config's value wins, as under DeepSpeed
            theirs = plugin.get_value("gradient_accumulation_steps")
            log_rank(
                logger, 30, f"gradient_accumulation_steps: Accelerator has {ours}, the ds_config {theirs}: {theirs}"
            )
            self.gradient_accumulation_steps = plugin.get_value("gradient_accumulation_steps")  # type: ignore[has-type]
        _check_pairing(plugin.deepspeed_config, optimizer, scheduler)
        if model is None:
            return tuple(result)

        _warn_if_built_whole(plugin, model)
        _mark_moe_leaves(plugin, model)
        config = plugin.deepspeed_config
        if isinstance(optimizer, torch.optim.Optimizer):
            config["zero_allow_untested_optimizer"] = True
        auto = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
        if micro_batch is not None:
            auto["train_micro_batch_size_per_gpu"] = micro_batch
            replicas = self.num_processes // sp
            auto["train_batch_size"] = micro_batch * plugin.get_value("gradient_accumulation_steps") * replicas
            # accelerate counts the windows: a resume on another world size must not change the engine's
            # accumulation to keep a global batch (checkpoint/load.py adapt_batch), as DeepSpeed never does
            config.setdefault("train_batch_size", auto["train_batch_size"])
        auto.update(_hidden_size_values(plugin, model))
        auto.update(self._dummy_values(optimizer, scheduler))
        plugin.deepspeed_config_process(must_match=False, **auto)
        if sp > 1 and micro_batch is not None:  # accelerate sets it last under sp, over any value, from its dp sizes;
            # here from world / sp, what DeepSpeed's batch check divides by (equal whenever DeepSpeed accepts them)
            config["train_batch_size"] = micro_batch * plugin.get_value("gradient_accumulation_steps") * replicas
        self.deepspeed_config = config

        kwargs: dict[str, Any] = {"model": model, "config": config}
        if sp > 1:  # [Note: Ulysses for Hugging Face models]: the attention wrapped, its groups for the engine
            kwargs["mpu"] = register(model, self.parallelism_config, micro_batch or 1)
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
            if scheduler is not None and type(scheduler).__name__ in VALID_LR_SCHEDULES:
                kwargs["lr_scheduler"] = scheduler
        engine, engine_optimizer, _, engine_scheduler = initialize(**kwargs)
        self._compile(engine)

        wrapped_optimizer = EngineOptimizerWrapper(engine_optimizer, engine) if engine_optimizer is not None else None
        if scheduler is not None:
            if engine_scheduler is None:  # the script's own schedule, stepped by the script
                scheduler = accelerate.scheduler.AcceleratedScheduler(
                    scheduler,
                    wrapped_optimizer,
                    step_with_optimizer=self.step_scheduler_with_optimizer,
                    split_batches=self.split_batches,
                )
            else:
                scheduler = DeepSpeedSchedulerWrapper(engine_scheduler, wrapped_optimizer)
        for i, obj in enumerate(result):
            if sp > 1 and isinstance(obj, torch.utils.data.DataLoader):  # each batch in sequence parts
                result[i] = adapt_dataloader(obj, engine, self.device)
            elif isinstance(obj, torch.nn.Module):
                result[i] = engine
            elif isinstance(obj, (torch.optim.Optimizer, DummyOptim)):
                result[i] = wrapped_optimizer
            elif _is_scheduler(obj):
                result[i] = scheduler
        if self.deepspeed_engine_wrapped is None:
            self.deepspeed_engine_wrapped = EngineWrapper(engine)
        else:  # accelerate's behaviour: the first engine stays the one backward() drives
            log_rank(
                logger,
                30,
                "A wrapped DeepSpeed engine reference is currently tied for this `Accelerator()` instance. If you want "
                "to call `accelerator.backward()` referencing a new model/engine, please create a separate "
                "`Accelerator()` instance and call `accelerator.prepare()` on it.",
            )
        self._models.append(engine)
        if wrapped_optimizer is not None:
            self._optimizers.append(wrapped_optimizer)
        if scheduler is not None:
            self._schedulers.append(scheduler)
        return tuple(result)

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        """A loader prepared apart from the model, in sequence parts (after `prepare(model)`), as accelerate's."""
        if self.parallelism_config is None or self.parallelism_config.sp_size == 1:
            return dl
        if self.deepspeed_engine_wrapped is None:
            raise ConfigError("deepspeed_ulysses_dl_adapter: prepare the model first (its engine holds the groups)")
        return adapt_dataloader(dl, self.deepspeed_engine_wrapped.engine, self.device)

    def _refuse_unsupported(self, plugin: DeepSpeedPlugin) -> None:
        if int(plugin.deepspeed_config.get("tensor_parallel", {}).get("autotp_size", 0) or 0) > 1:
            raise ConfigError(
                "zeroshard.hf.Accelerator: tensor_parallel.autotp_size > 1 is not implemented (the data loaders "
                "would need accelerate's tensor-parallel mesh); call zeroshard.initialize directly"
            )
        if self.fp8_enabled or plugin.enable_msamp:
            raise ConfigError("zeroshard.hf.Accelerator: mixed_precision fp8 (MS-AMP) is not supported; use bf16")

    def _micro_batch(self, plugin: DeepSpeedPlugin, loaders: list[Any]) -> int | None:
        """`train_micro_batch_size_per_gpu`: the config's, or the loaders' batch size (accelerate's rule)."""
        if not plugin.is_auto("train_micro_batch_size_per_gpu"):
            return plugin.get_value("train_micro_batch_size_per_gpu")
        sizes = [loader.batch_size for loader in loaders]
        if not sizes or any(size is None for size in sizes):
            raise ConfigError(
                'train_micro_batch_size_per_gpu is "auto": pass a DataLoader with a batch_size to prepare() '
                "(with the model), or set the value in the ds_config"
            )
        if self.split_batches:
            sizes = [size // self.num_processes for size in sizes]
        return min(sizes) if plugin.is_train_batch_min else max(sizes)

    def _dummy_values(self, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        if isinstance(optimizer, DummyOptim):
            values.update(
                {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay}
            )
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            defaults = getattr(scheduler.optimizer, "defaults", None)
            max_lr = defaults["lr"] if defaults is not None else getattr(scheduler.optimizer, "lr", None)
            values.update(
                {
                    "scheduler.params.warmup_min_lr": 0,
                    "scheduler.params.warmup_max_lr": max_lr,
                    "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),
                }
            )
            if scheduler.total_num_steps is not None:  # accelerate counts steps for all processes together
                total = scheduler.total_num_steps
                values["scheduler.params.total_num_steps"] = (
                    total if self.split_batches else math.ceil(total / self.num_processes)
                )
        return values

    def _compile(self, engine: Engine) -> None:
        dynamo = self.state.dynamo_plugin
        if dynamo.backend == accelerate.utils.DynamoBackend.NO:
            return
        compile_kwargs = dynamo.to_kwargs()
        if dynamo.use_regional_compilation:
            compile_regions_deepspeed(engine.module, **compile_kwargs)
        else:
            engine.compile(backend=compile_kwargs.pop("backend"), compile_kwargs=compile_kwargs)

    # -- the model's weights ----------------------------------------------------------------------------
    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if isinstance(model, Engine):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        """accelerate's, after committing a decoupled save still in flight: with `total_limit`, accelerate deletes
        the oldest folders before it saves ([Note: decoupled checkpoint writes])."""
        for model in self._models:
            if isinstance(model, Engine):
                model.commit_checkpoint("save_checkpoint")
        return super().save_state(*args, **kwargs)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
        """The full weights (every rank must call it). Stage 3: in the compute dtype on rank 0 (None elsewhere), and
        only with `stage3_gather_16bit_weights_on_model_save`, as under DeepSpeed; stages 0-2: a CPU copy of the
        module's state dict on every rank (experts split over ranks whole)."""
        if self.distributed_type != DistributedType.DEEPSPEED or not isinstance(model, Engine):
            return super().get_state_dict(model, unwrap=unwrap)
        return engine_state_dict(model)


class EngineWrapper:
    """What accelerate's `backward` and `clip_grad_norm_` call under DeepSpeed (its `DeepSpeedEngineWrapper`)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        if self.engine.managed_gradient_accumulation():  # else step() alone ends the window
            self.engine.set_gradient_accumulation_boundary(sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:  # clipping, the optimizer step and the config's scheduler step
            self.engine.step()

    def get_global_grad_norm(self) -> torch.Tensor | None:
        return self.engine.get_global_grad_norm()


class EngineOptimizerWrapper(DeepSpeedOptimizerWrapper):  # type: ignore[misc]
    """The optimizer `prepare` returns: `step`/`zero_grad` do nothing (the engine stepped in `backward`);
    `step_was_skipped` is the engine's answer (an fp16 overflow), which accelerate's scheduler wrapper reads."""

    def __init__(self, optimizer: ScriptOptimizer, engine: Engine):
        super().__init__(optimizer)
        self._engine = engine

    @property
    def step_was_skipped(self) -> bool:
        return self._engine.global_steps > 0 and not self._engine.was_step_applied()


def _name_deepspeed_classes() -> None:
    """Without DeepSpeed installed, the names accelerate re-exports only with it, bound to the same classes (a name
    that exists is left alone)."""
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.deepspeed

    for module in (accelerate.utils, accelerate.accelerator):
        for name in _DEEPSPEED_NAMES:
            if not hasattr(module, name):
                setattr(module, name, getattr(accelerate.utils.deepspeed, name))


_name_deepspeed_classes()


def _ulysses_only(pc: Any) -> Any:
    """accelerate's ParallelismConfig under DeepSpeed: Ulysses (sp_backend "deepspeed", sp_size > 1) or nothing."""
    if pc is None:
        return None
    if pc.tp_size > 1 or pc.cp_size > 1 or (pc.sp_size == 1 and (pc.dp_shard_size > 1 or pc.dp_replicate_size > 1)):
        raise ConfigError(
            "zeroshard.hf.Accelerator: parallelism_config with tp_size or cp_size > 1 (or dp sizes without sp_size) "
            "is not implemented; use sp_size (Ulysses) with the ds_config, or zeroshard.initialize with "
            "tensor_parallel"
        )
    if pc.sp_size > 1 and pc.sp_backend != "deepspeed":
        raise ConfigError(f"parallelism_config.sp_backend={pc.sp_backend!r}: Ulysses needs sp_backend='deepspeed'")
    return pc if pc.sp_size > 1 else None


def _one_plugin(plugins: Any) -> DeepSpeedPlugin | None:
    """The DeepSpeed plugin: given, left by an earlier Accelerator, or from `accelerate launch`'s environment."""
    if isinstance(plugins, dict):
        if len(plugins) != 1:
            raise ConfigError(
                f"zeroshard.hf.Accelerator: {len(plugins)} DeepSpeed plugins given; one model per Accelerator "
                "is supported, pass one DeepSpeedPlugin"
            )
        plugins = next(iter(plugins.values()))
    earlier = AcceleratorState._shared_state and AcceleratorState().distributed_type == DistributedType.DEEPSPEED
    if plugins is not None:
        if earlier:  # accelerate's rule
            raise NotImplementedError(
                "You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`. Please make sure the "
                "first `Accelerator` is initialized with all the plugins you want to use."
            )
        return plugins  # type: ignore[no-any-return]
    if earlier:
        return AcceleratorState().deepspeed_plugin  # type: ignore[no-any-return]
    if launched_with_deepspeed():  # `accelerate launch`'s variable (a TrainingArguments may have taken it)
        return DeepSpeedPlugin()
    return None


@contextlib.contextmanager
def _deepspeed_hidden() -> Iterator[None]:
    """accelerate's constructor without its DeepSpeed branch: no `ACCELERATE_USE_DEEPSPEED` (which starts the
    process group through `deepspeed.comm`), and an existing state in DeepSpeed mode shows the plain type."""
    saved_env = os.environ.pop(_USE_DEEPSPEED, None)
    states = [AcceleratorState._shared_state, PartialState._shared_state]
    deepspeed_mode = [shared.get("distributed_type") == DistributedType.DEEPSPEED for shared in states]
    plain = _plain_type() if any(deepspeed_mode) else None
    for shared, flip in zip(states, deepspeed_mode, strict=True):
        if flip:
            shared["distributed_type"] = plain
    try:
        yield
    finally:
        if saved_env is not None:
            os.environ[_USE_DEEPSPEED] = saved_env
        for shared, flip in zip(states, deepspeed_mode, strict=True):
            if flip:
                shared["distributed_type"] = DistributedType.DEEPSPEED


def _plain_type() -> DistributedType:
    """What accelerate's state would say without DeepSpeed, for an existing process group."""
    if PartialState._shared_state.get("num_processes", 1) <= 1:
        return DistributedType.NO
    return DistributedType.MULTI_GPU if torch.cuda.is_available() else DistributedType.MULTI_CPU


def _warn_if_built_whole(plugin: DeepSpeedPlugin, model: torch.nn.Module) -> None:
    """ZeRO-3 with accelerate's `zero3_init_flag` (its default at stage 3): under DeepSpeed, `from_pretrained`
    would have partitioned the model as it was built; here it was built whole on every rank."""
    if not (plugin.zero3_init_flag and plugin.zero_stage == 3):
        return
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        return  # built under zeroshard.zero_init(): initialize reads each rank's shards
    size = sum(p.numel() * p.element_size() for p in params) / 2**30
    log_rank(
        logger,
        30,
        f"zero3_init_flag: the model was built whole on every rank ({size:.2f} GiB each) before prepare(), which "
        "shards it now; accelerate + DeepSpeed would have partitioned it while loading. To load it sharded, build "
        "it under `with zeroshard.zero_init():` (from_pretrained then streams each rank's shards)",
    )


def _mark_moe_leaves(plugin: DeepSpeedPlugin, model: torch.nn.Module) -> None:
    """accelerate's `transformer_moe_cls_names` (ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES): those classes are
    gathered whole at stage 3 ([Note: leaf modules])."""
    from zeroshard.utils.z3_leaf_module import set_z3_leaf_modules

    names = plugin.transformer_moe_cls_names or os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")
    if not names:
        return
    classes = []
    for name in names.split(","):
        cls = get_module_class_from_name(model, name)
        if cls is None:
            raise ConfigError(f"transformer_moe_cls_names: no module class {name!r} in the model")
        classes.append(cls)
    set_z3_leaf_modules(model, classes)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (LRScheduler, DummyScheduler)) or type(obj).__name__ in VALID_LR_SCHEDULES


def _check_pairing(config: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    """accelerate's rules for the config's optimizer/scheduler blocks against the objects the script passes."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ConfigError(
                "the ds_config has an optimizer block and the script passes an optimizer: remove one (the script "
                "can pass accelerate.utils.DummyOptim to use the config's)"
            )
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ConfigError("DummyOptim needs an optimizer block in the ds_config")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ConfigError(
                "the ds_config has a scheduler block and the script passes a scheduler: remove one (the script "
                "can pass accelerate.utils.DummyScheduler to use the config's)"
            )
        if "scheduler" not in config and isinstance(scheduler, DummyScheduler):
            if scheduler.lr_scheduler_callable is None:
                raise ConfigError("DummyScheduler needs a scheduler block in the ds_config or lr_scheduler_callable")
    if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
        raise ConfigError("with DummyOptim the scheduler must be a DummyScheduler")


def _hidden_size_values(plugin: DeepSpeedPlugin, model: torch.nn.Module) -> dict[str, int]:
    """The "auto" bucket sizes accelerate derives from the model's hidden size."""
    keys = [key for key in _HIDDEN_SIZE_KEYS if plugin.is_auto(key)]
    if not keys:
        return {}
    hidden = hidden_size(model)  # the Trainer's rule: hidden_size, else the largest of hidden_sizes
    if hidden is None:
        raise ConfigError(f'{keys} are "auto" but the model has no config.hidden_size: set them in the ds_config')
    return {key: _HIDDEN_SIZE_KEYS[key](hidden) for key in keys}
