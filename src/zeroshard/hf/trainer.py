"""`Trainer` and `TrainerMixin`: the Hugging Face Trainer's loop with the zeroshard engine under it.

[Note: which Trainer methods we override]
transformers' own loop (`_inner_training_loop`, `_run_epoch`, `training_step`, logging, callbacks, evaluation)
runs unchanged; what DeepSpeed changes in it, we change at the same points, and nothing else:

- `create_accelerator_and_postprocess`: the accelerator is wrapped by `EngineAccelerator`, which hands
  `backward` and clipping to the engine ([Note: the Trainer's loop over the engine]).
- `_prepare_for_training` (where transformers calls `deepspeed_init` and `accelerator.prepare`): build the engine
  once (`zeroshard.initialize` with the config resolved from the arguments, [Note: the Trainer's "auto" rules]),
  and on `resume_from_checkpoint` load its checkpoint from the `checkpoint-N` folder.
- `_wrap_model`: the engine is the wrapped model, for evaluation and prediction too (with nothing to train, built
  without optimizer and scheduler, as transformers' `deepspeed_init(inference=True)`).
- `call_model_init` / `_move_model_to_device`: at stage 3 a `model_init` runs under `zeroshard.zero_init()`, and
  the engine, not the Trainer, places (and shards) the model.
- `_save_optimizer_and_scheduler` / `_load_from_checkpoint` / `_load_best_model`: the engine's sharded checkpoint
  (`checkpoint-N/global_stepN`, DeepSpeed's layout) holds weights, optimizer, scheduler and loss scale;
  `_save_checkpoint` / `train`: with decoupled saves, old checkpoints are rotated out once the new one is committed,
  and `train()` returns with its last save committed.
- `save_model`: the consolidated weights through transformers' own `_save`, so the folder loads with
  `from_pretrained` (a PEFT model writes its adapter, as the plain Trainer does); a checkpoint whose weights stay
  sharded gets what transformers writes there under DeepSpeed (`_save_sharded`).

The optimizer and scheduler come from the config's `optimizer` / `scheduler` blocks when present, else from the
Trainer (`create_optimizer`, `create_scheduler`: AdamW and the `lr_scheduler_type` schedule), as under DeepSpeed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import remove_dummy_checkpoint
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from zeroshard.checkpoint.decoupled import decoupled
from zeroshard.config import ZeroshardConfig
from zeroshard.engine import Engine
from zeroshard.errors import ConfigError
from zeroshard.hf.arguments import (
    config_source,
    refuse_best_model_without_checkpoint,
    refuse_precompute_at_stage3,
    trainer_arguments,
)
from zeroshard.hf.auto import trainer_config, without_training
from zeroshard.hf.link import EngineAccelerator, EngineLink, EngineOptimizer
from zeroshard.hf.schedulers import scheduler_for_engine, scheduler_for_trainer
from zeroshard.hf.ulysses import register, sequence_parallel_loss, ulysses_parallelism
from zeroshard.initialize import initialize
from zeroshard.utils.logging import get_logger, log_rank
from zeroshard.zero.stage3.meta import zero_init

logger = get_logger(__name__)


class TrainerMixin:
    """Put in front of a `transformers.Trainer` subclass (e.g. TRL's) to train it with zeroshard.

    The ds_config is `args.deepspeed` of `zeroshard.hf.TrainingArguments` (or of a config class with
    `TrainingArgumentsMixin` in front), or the `zeroshard_config=` argument (a path or a dict).

    Example:
        >>> from trl import SFTTrainer  # doctest: +SKIP
        >>> class SFT(TrainerMixin, SFTTrainer):  # doctest: +SKIP
        ...     pass
        >>> SFT(model=model, args=args, train_dataset=data, zeroshard_config="ds_config.json").train()  # doctest: +SKIP
    """

    # what transformers.Trainer provides (the mixin's partner class)
    args: Any
    model: Any
    model_wrapped: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any
    callback_handler: Any
    state: Any
    control: Any

    def __init__(self, *args: Any, zeroshard_config: Any = None, **kwargs: Any):
        given = trainer_arguments(super().__init__, args, kwargs)  # TRL's DPO takes (model, ref_model, args, ...)
        training_args: Any = given.get("args")
        if getattr(training_args, "n_gpu", 1) > 1:
            # one device per process, as under DeepSpeed: transformers' plain path counts a lone process's GPUs (for
            # nn.DataParallel), fed N micro-batches as one and divided the loss's token count by N
            training_args._n_gpu = 1
        self.zeroshard_link = EngineLink()
        self._zeroshard_source = config_source(training_args, zeroshard_config)
        refuse_precompute_at_stage3(self._zeroshard_source, training_args, given.get("ref_model"))
        refuse_best_model_without_checkpoint(training_args)
        self._zeroshard_steps: int | None = None
        self._zeroshard_inference = False  # the engine was built for evaluation only, without optimizer
        self._ulysses: Any = None  # the ParallelismConfig when it asks for Ulysses
        self._zeroshard_mpu: Any = None  # its groups, for the engine (and a reference model's)
        self._saved_pending: Any = None  # the decoupled save the next on_save event is about
        self._committed_saves: list[Any] = []  # the states of committed saves whose on_save is still to come
        super().__init__(*args, **kwargs)
        self._zeroshard_given = (self.optimizer, self.lr_scheduler)  # Trainer(optimizers=...): hf/schedulers.py
        handler = self.callback_handler
        handler.on_save = functools.partial(_on_save_once_committed, self, handler.on_save)
        handler.on_step_end = functools.partial(_on_step_end_after_saves, self, handler.on_step_end)

    @property
    def engine(self) -> Engine | None:
        """The zeroshard engine, once training (or evaluation) has started."""
        return self.zeroshard_link.engine

    # -- building -----------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        # [Note: the Trainer's sequence parallelism]: the accelerator is built without it and answers it back
        self._ulysses = ulysses_parallelism(self.args)
        if self._ulysses is not None:
            self.args.parallelism_config = None
        try:
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        finally:
            if self._ulysses is not None:
                self.args.parallelism_config = self._ulysses
        self.accelerator = EngineAccelerator(self.accelerator, self.zeroshard_link, self._ulysses)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        if int(self._zeroshard_source.zero_optimization.stage) == 3:
            with zero_init():  # each rank keeps only its shards: [Note: streaming load]
                return super().call_model_init(trial)  # type: ignore[misc,no-any-return]
        return super().call_model_init(trial)  # type: ignore[misc,no-any-return]

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """At stages 0-2 where `initialize` would put it anyway, now: TRL runs the model in its constructor
        (`precompute_ref_log_probs` without a ref_model) on batches its accelerator put on the device. At stage 3
        `initialize` shards it, and a whole copy on every GPU is what ZeRO-3 avoids."""
        if int(self._zeroshard_source.zero_optimization.stage) < 3:
            super()._move_model_to_device(model, device)  # type: ignore[misc]

    def _build_engine(self, num_training_steps: int, inference: bool = False) -> Engine:
        """The engine, built once: [Note: which Trainer methods we override]. `inference` (an `evaluate()` or
        `predict()` with nothing to train): without the config's optimizer and scheduler, as transformers builds
        DeepSpeed's for evaluation (`deepspeed_init(inference=True)`)."""
        if self.engine is not None and self._zeroshard_inference and not inference:
            raise ConfigError(
                "train() after evaluate()/predict() ran with nothing to train (no train_dataset, max_steps <= 0): "
                "that engine has no optimizer; build the Trainer with its train_dataset (or max_steps) to train"
            )
        if self.engine is not None:
            if num_training_steps != self._zeroshard_steps:
                log_rank(
                    logger,
                    30,
                    f"the engine was built for {self._zeroshard_steps} steps; training runs "
                    f"{num_training_steps} (the scheduler keeps the first)",
                )
            return self.engine
        sp = self._ulysses.sp_size if self._ulysses is not None else 1
        replicas = self.args.world_size // sp  # the batch arithmetic counts replicas
        source = without_training(self._zeroshard_source) if inference else self._zeroshard_source
        cfg = trainer_config(source, self.args, self.model, num_training_steps, replicas)
        if cfg.checkpoint.use_node_local_storage and not self.args.save_on_each_node:  # [Note: node-local ..]
            raise ConfigError(
                "checkpoint.use_node_local_storage: set save_on_each_node=True in the TrainingArguments, so that "
                "every node keeps its trainer_state.json and rotates its own checkpoint-N folders"
            )
        training = not inference
        optimizer = self.create_optimizer() if cfg.optimizer is None and training else None  # type: ignore[attr-defined]
        if optimizer is not None:  # the Trainer's own optimizer (optim=...): transformers allows it under DeepSpeed
            cfg = dataclasses.replace(cfg, zero_allow_untested_optimizer=True)  # (a whole-tensor one is still refused)
        scheduler = scheduler_for_engine(self, cfg, num_training_steps) if training else None  # (hf/schedulers.py)

        # initialize parses its config with parse_config, which takes a ZeroshardConfig as it is
        if sp > 1:
            self._zeroshard_mpu = register(self.model, self._ulysses, self.args.per_device_train_batch_size)
        engine, *_ = initialize(
            model=self.model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=cfg,  # type: ignore[arg-type]
            mpu=self._zeroshard_mpu,
        )
        self.zeroshard_link.engine = engine
        self._zeroshard_steps, self._zeroshard_inference = num_training_steps, inference
        self._shard_reference_model(cfg)
        self.model_wrapped = engine
        if training:
            self.optimizer = EngineOptimizer(self.zeroshard_link)
            self.lr_scheduler = scheduler_for_trainer(engine, self.zeroshard_link)
        return engine

    def _shard_reference_model(self, cfg: ZeroshardConfig) -> None:
        """TRL's frozen reference model (`ref_model` of DPO, KTO, GRPO, ...): at stage 3 sharded as the trained one,
        an engine without optimizer in eval mode, as TRL's `prepare_deepspeed` makes it under DeepSpeed (the
        config less its optimizer, scheduler and optimizer offload); at stages 0-2 it stays whole, as there."""
        ref = getattr(self, "ref_model", None)
        if not isinstance(ref, nn.Module) or isinstance(ref, Engine) or int(cfg.zero_optimization.stage) != 3:
            return
        if getattr(self.args, "sync_ref_model", False):
            raise ConfigError(
                "sync_ref_model with zero_optimization.stage 3 is not supported: TRL's sync reads the sharded "
                "parameters directly (it gathers them only through DeepSpeed); use stage 1 or 2, or sync_ref_model "
                "false"
            )
        config = cfg.to_dict(include_defaults=False)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config.get("zero_optimization", {}).pop("offload_optimizer", None)
        engine, *_ = initialize(model=ref, config=config, mpu=self._zeroshard_mpu)  # the same groups under sp
        engine.eval()
        self.ref_model = engine

    def _planned_steps(self) -> int:
        """The run's optimizer steps, for an engine built by `evaluate()` before `train()`."""
        if self.args.max_steps > 0 or getattr(self, "train_dataset", None) is None:
            return max(int(self.args.max_steps), 0)
        values = self.set_initial_training_values(self.args, self.get_train_dataloader())  # type: ignore[attr-defined]
        return int(values[-1])

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> Any:
        engine = self._build_engine(max_steps)
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(resume_from_checkpoint, load_module_strict=not _is_peft(self.model))
            if path is None:
                before, folder = _committed_before(resume_from_checkpoint), resume_from_checkpoint
                why = "a decoupled save that was never committed leaves none"
                if any(os.path.exists(os.path.join(folder, f)) for f in _MODEL_FILES):  # (save_only_model=True)
                    why = (
                        "it holds the model only, as save_only_model=True saves it; resuming needs the optimizer state"
                    )
                raise ConfigError(
                    f"no zeroshard checkpoint (a `latest` file) in {folder} ({why})"
                    + (f"; the last committed one is {before}" if before else "")
                )
        if self._ulysses is not None:  # [Note: the Trainer's sequence parallelism]
            train_dataloader = self.accelerator.deepspeed_ulysses_dl_adapter(train_dataloader, engine)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if self._ulysses is not None and self.model.training and self.engine is not None:
            return sequence_parallel_loss(self.engine, model, inputs, return_outputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        steps = self._zeroshard_steps
        steps = steps if steps is not None else self._planned_steps()
        return self._build_engine(steps, inference=steps == 0)

    # -- saving and loading -------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a `from_pretrained` folder of the trained weights (every rank must call it; rank 0 writes)."""
        engine = self.engine
        if engine is None:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        output_dir = output_dir or self.args.output_dir
        refused = engine.strategy.consolidation_refused() if engine.strategy is not None else None
        gather = engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        # a PEFT model's adapter whatever the flag, as transformers gathers it under DeepSpeed at stage 3
        # (`_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)`, which does not read the flag)
        if _internal_call and (refused or (engine.zero_stage == 3 and not gather and not _is_peft(self.model))):
            self._save_sharded(engine, output_dir, refused)
            return
        # gathered unit by unit onto the writer's CPU in the compute dtype; the other ranks take part and keep nothing
        # (transformers' _save returns on them)
        writer = bool(self.args.should_save)  # type: ignore[attr-defined]
        state = engine.consolidated_state_dict(engine.precision.compute_dtype, writer, torch.device("cpu"))
        self._save(output_dir, state_dict=state)  # type: ignore[attr-defined]

    def _save_sharded(self, engine: Engine, output_dir: str, refused: str | None) -> None:
        """A checkpoint whose weights stay in the engine checkpoint (stage 3 without
        `stage3_gather_16bit_weights_on_model_save`, or weights the engine cannot consolidate), as transformers
        writes it under DeepSpeed: the model's config files and `training_args.bin` (`_save` of an empty state dict,
        the weights file removed); with `save_only_model`, where `_save_optimizer_and_scheduler` does not run, the
        engine checkpoint too (DeepSpeed's `save_checkpoint` fallback)."""
        peft = _is_peft(self.model)
        why = refused or "set zero_optimization.stage3_gather_16bit_weights_on_model_save to write it"
        log_rank(logger, 20, f"checkpoint: no model weights file ({why}); the engine checkpoint keeps every shard")
        if not peft:
            self._save(output_dir, state_dict={})  # type: ignore[attr-defined]
            remove_dummy_checkpoint(self.args.should_save, output_dir, [WEIGHTS_NAME, SAFE_WEIGHTS_NAME])
        elif self.args.should_save:  # (an empty adapter file would load as untrained weights)
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.save_only_model:
            engine.save_checkpoint(output_dir, exclude_frozen_parameters=peft)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.engine
        if engine is None:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
            return
        engine.save_checkpoint(output_dir, exclude_frozen_parameters=_is_peft(self.model))

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """With decoupled saves ([Note: decoupled checkpoint writes]) what reads the new checkpoint waits for its
        commit: the rotation of old checkpoints (`save_total_limit`; until then they are what a crashed run resumes
        from) and the callbacks' `on_save` (W&B, MLflow, Neptune, ClearML upload the folder there)."""
        engine, limit = self.engine, self.args.save_total_limit  # type: ignore[attr-defined]
        if engine is None or not decoupled(engine):
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            return
        self.args.save_total_limit = None  # type: ignore[attr-defined]
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self.args.save_total_limit = limit  # type: ignore[attr-defined]
        pending = self._saved_pending = engine._pending_save  # None: nothing of the engine's saved (save_only_model)
        if not limit or not self.args.should_save:  # type: ignore[attr-defined]
            return
        rotate = functools.partial(self._rotate_after_commit, trial, limit)
        if pending is None:
            rotate()
        else:
            pending.after_commit(rotate)

    def _rotate_after_commit(self, trial: Any, limit: int) -> None:
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        try:
            from transformers.trainer_utils import rotate_checkpoints  # transformers >= 5
        except ImportError:  # 4.x: a Trainer method reading args.save_total_limit
            self._rotate_checkpoints(use_mtime=False, output_dir=run_dir)  # type: ignore[attr-defined]
            return
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """The last checkpoint is committed (and the old ones rotated) before transformers deletes checkpoints for
        save_total_limit 1, loads the best model, runs on_train_end and finishes its upload."""
        self._commit_pending()
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        strategy = getattr(self.args, "hub_strategy", None)  # type: ignore[attr-defined]
        if str(getattr(strategy, "value", strategy)) in ("checkpoint", "all_checkpoints"):
            self._commit_pending()  # the checkpoint folder is uploaded: committed first (every rank comes here)
        super()._push_from_checkpoint(checkpoint_folder)  # type: ignore[misc]

    def _sorted_checkpoints(self, *args: Any, **kwargs: Any) -> Any:
        """transformers 4.x's end-of-training cleanup lists (and may delete) checkpoints here: committed first."""
        self._commit_pending()
        return super()._sorted_checkpoints(*args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """transformers' `train()`, returning with no decoupled save in flight (transformers 4.x has no
        `_finalize_training`). `resume_from_checkpoint=True` resumes from the newest `checkpoint-N` whose zeroshard
        checkpoint was committed (a run that stopped during a decoupled save leaves a newer one that was not)."""
        if resume_from_checkpoint is True:
            saver = bool(self.args.should_save)  # type: ignore[attr-defined]
            resume_from_checkpoint = newest_committed(self.args.output_dir, set_aside=saver) or True
        result = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        self._commit_pending()
        return result

    def _commit_pending(self) -> None:
        if self.engine is not None:
            self.engine.commit_checkpoint()
        self.control = self._announce_saves(self.control)

    def _announce_saves(self, control: Any) -> Any:
        """The callbacks' `on_save` for each committed decoupled save, with the state as it was at the save, from
        the training loop (not from inside the engine's step that committed it)."""
        while self._committed_saves:
            at_save = self._committed_saves.pop(0)
            control = self.callback_handler.call_event("on_save", self.args, at_save, control)
        return control

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        pass  # the engine loads its checkpoint in _prepare_for_training

    def _load_best_model(self) -> None:
        engine = self.engine
        if engine is None:
            super()._load_best_model()  # type: ignore[misc]
            return
        best = self.state.best_model_checkpoint
        log_rank(logger, 20, f"loading the best model from {best}")
        engine.load_checkpoint(best, load_module_strict=not _is_peft(self.model), load_module_only=True)

    # -- generation ---------------------------------------------------------------------------------------
    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None, **gen_kwargs: Any
    ) -> Any:
        """[Note: generation at stage 3] the Seq2SeqTrainer passes `synced_gpus` from transformers' DeepSpeed test,
        False under zeroshard: where every forward communicates (stage 3, experts split over ranks) on several ranks
        it is True here, as under DeepSpeed ZeRO-3."""
        engine = self.engine
        generates = bool(getattr(self.args, "predict_with_generate", False)) and not prediction_loss_only
        if not generates or engine is None or not engine.forward_communicates():
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)  # type: ignore[misc]
        if not gen_kwargs and hasattr(self, "_gen_kwargs"):  # what Seq2SeqTrainer would fall back to
            gen_kwargs = dict(self._gen_kwargs)
        gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)  # type: ignore[misc]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """`model.generate(...)` with the parameters gathered once for the whole call (stage 3), not per token.
        Every rank must call it."""
        engine = self.engine
        model: Any = engine.module if engine is not None else self.model
        with torch.no_grad():
            if engine is None:
                return model.generate(*args, **kwargs)
            was_training = model.training
            model.eval()
            try:
                with engine.gathered_for_generation():
                    return model.generate(*args, **kwargs)
            finally:
                model.train(was_training)


class Trainer(TrainerMixin, transformers.Trainer):
    """`transformers.Trainer` trained by zeroshard: the same script, with `deepspeed=` (or `--deepspeed`) read by
    `zeroshard.hf.TrainingArguments`. Launch with `zeroshard launch` or `torchrun`; DeepSpeed is not needed.

    Example:
        >>> from zeroshard.hf import Trainer, TrainingArguments
        >>> args = TrainingArguments("out", deepspeed="ds_config.json", per_device_train_batch_size=4)  # doctest: +SKIP
        >>> Trainer(model=model, args=args, train_dataset=data).train()  # doctest: +SKIP
    """


def _on_save_once_committed(trainer: TrainerMixin, on_save: Any, args: Any, state: Any, control: Any) -> Any:
    """The callbacks' `on_save` for a decoupled save runs once it is committed (at the next step, or the end of
    training), with the state as it was at the save; what they change in `control` then applies from that step."""
    pending: Any = trainer._saved_pending
    trainer._saved_pending = None
    engine = trainer.engine
    committed = engine is None or engine._pending_save is not pending
    if pending is None or committed:  # not decoupled (or nothing of the engine's saved), or committed already
        return on_save(args, state, control)
    control.should_save = False  # the handler's part, now: the loop must not save again before the commit
    pending.after_commit(functools.partial(trainer._committed_saves.append, copy.deepcopy(state)))
    return control


def _on_step_end_after_saves(
    trainer: TrainerMixin, on_step_end: Any, args: Any, state: Any, control: Any, **kwargs: Any
) -> Any:
    """The callbacks' `on_save` of the saves committed during this step, then the step's end."""
    return on_step_end(args, state, trainer._announce_saves(control), **kwargs)


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def newest_committed(output_dir: str, set_aside: bool = False) -> str | None:
    """What `resume_from_checkpoint=True` resumes from: transformers' newest `checkpoint-N` in `output_dir`, or,
    when its zeroshard checkpoint was never committed, the newest one before it that was (with a warning); None
    when there is none (transformers then says so, or `_prepare_for_training` names the uncommitted one).
    `set_aside` (the saving process): the uncommitted folder is renamed `uncommitted-checkpoint-N`, so that
    `save_total_limit` does not keep it, as the newest, in place of the committed checkpoints."""
    from transformers.trainer_utils import get_last_checkpoint

    newest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if newest is None or os.path.exists(os.path.join(newest, "latest")):
        return newest
    before = _committed_before(newest)
    if before is None:
        return None
    aside = ""
    if set_aside:
        target = os.path.join(output_dir, f"uncommitted-{os.path.basename(newest)}")
        while os.path.exists(target):
            target += "+"
        os.rename(newest, target)
        aside = f" (set aside as {target})"
    log_rank(
        logger,
        30,
        f"resume_from_checkpoint=True: {newest} holds no committed zeroshard checkpoint (no `latest`: the run "
        f"stopped before its save was committed){aside}; resuming from {before}",
    )
    return before


_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")


def _committed_before(folder: str) -> str | None:
    """The newest `checkpoint-N` beside `folder` that holds a committed zeroshard checkpoint (a `latest`)."""
    parent = os.path.dirname(os.path.abspath(folder))
    found = []
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        step = name.rpartition("-")[2]
        if name.startswith("checkpoint-") and step.isdigit() and os.path.exists(os.path.join(parent, name, "latest")):
            found.append((int(step), os.path.join(parent, name)))
    return max(found)[1] if found else None
