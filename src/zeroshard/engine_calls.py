"""DeepSpeed's engine calls that change or hand out what the configuration set up: `set_train_batch_size`,
`set_train_micro_batch_size`, `module_state_dict`, `load_module_state_dict`,
`empty_partition_cache`, `deepspeed_io`. A mixin of `Engine`; the configuration accessors are in engine_settings.py
([Note: DeepSpeed's configuration accessors])."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from zeroshard.checkpoint.torn import refuse_torn
from zeroshard.comm.divergence import group_timeout_s, raised_on_every_rank
from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import BUFFERS, GRADS, PARAMS, offload_device, offload_kinds
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


class DeepSpeedCalls:
    """DeepSpeed's engine calls that act on the engine's batch sizes, module and data; a base of `Engine`."""

    config: Any
    module: torch.nn.Module
    strategy: Any
    accumulation: Any  # AccumulationState
    tput_timer: Any
    telemetry: Any
    loss_scaler: Any
    _manual: Any  # ManualBackward
    _compute: Any  # the engine's compute context (tensor parallelism's vocab-parallel loss), else nullcontext
    _torn_load: Any  # CheckpointMixin's: [Note: a torn load]
    _offloader: Any  # StateOffloader: offload_states()
    comm: Any  # Collectives
    device: torch.device
    # set by `initialize`: the collate_fn it was given, and (this replica's index, replicas, whether the training
    # route shuffles) of the data
    collate_fn: Callable[..., Any] | None = None
    data_replica: tuple[int, int, bool] | None = None

    if TYPE_CHECKING:  # Engine's and EngineAccessors'

        @property
        def zero_stage(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def loss_scale(self) -> float: ...

        def _require_optimizer(self, what: str) -> Any: ...

        def is_gradient_accumulation_boundary(self) -> bool: ...

        def commit_checkpoint(self, *args: Any, **kwargs: Any) -> Any: ...

        def _deadline(self, what: str) -> contextlib.AbstractContextManager[None]: ...

    # -- batch sizes ----------------------------------------------------------------------------------
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch from the next micro-step on, by changing `gradient_accumulation_steps` (the micro-batch
        stays). As DeepSpeed: the boundary stays `(micro_steps + 1) % gradient_accumulation_steps == 0`, so a
        window open at the change ends where that count says."""
        config = self.config
        micro = int(config.train_micro_batch_size_per_gpu)
        replicas = int(config.train_batch_size) // (micro * int(config.gradient_accumulation_steps))
        if train_batch_size <= 0 or train_batch_size % (micro * replicas):
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): the global batch must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x data-parallel replicas = {micro} x {replicas}"
            )
        self._set_batch(train_batch_size, micro, train_batch_size // (micro * replicas))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """A new micro-batch per rank, keeping `gradient_accumulation_steps` (the global batch follows). The
        engine's own dataloader keeps its batch size, as DeepSpeed's does: feed batches of the new size."""
        config = self.config
        gas = int(config.gradient_accumulation_steps)
        replicas = int(config.train_batch_size) // (int(config.train_micro_batch_size_per_gpu) * gas)
        if micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): the micro-batch must be positive")
        self._set_batch(micro_batch_size * gas * replicas, micro_batch_size, gas)

    def _set_batch(self, train_batch_size: int, micro: int, gas: int) -> None:
        refused = self.strategy.window_change_refused(gas) if self.strategy is not None else None
        if refused is not None:
            raise ZeroshardError(refused)
        self.config = dataclasses.replace(
            self.config,
            train_batch_size=train_batch_size,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=gas,
        )
        self.accumulation.gradient_accumulation_steps = gas  # the strategy reads the window from here
        self.tput_timer.batch_size = train_batch_size
        if self.telemetry.profiler is not None:  # the FLOPs profile's "batch size per GPU"
            self.telemetry.profiler.micro_batch_size = micro

    # -- module state -----------------------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The module's state_dict (gathered under stage 3; every rank must call it then), without the frozen
        parameters when asked."""
        refuse_torn(self, "module_state_dict")
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Callable[..., Any] | None = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: Any = None,
        allowed_missing_keys: Any = None,
    ) -> None:
        """Load `checkpoint["module"]` into the module; every rank must call it, and rank 0's values become every
        rank's, master weights included (DeepSpeed's `modifier_rank=0`). Stage 3 gathers the whole module around the
        load whether or not `fetch_z3_params`/`z3_params_to_fetch` ask for it. The keys are torch's (its load-time
        hooks run); a load that fails, on a key or a shape, leaves the module as it was, except where the fp32
        master weights are the parameters themselves (fp32 stage 0)."""
        from zeroshard.zero.stage3.gathered import GatheredParameters

        refused = self.strategy.module_load_refused() if self.strategy is not None else None
        if self.strategy is not None:
            self.strategy.refuse_offloaded("load_module_state_dict")
        if refused is not None:
            raise ZeroshardError(refused)
        state = checkpoint["module"]
        if self.strategy is not None:  # [Note: gathering calls agree first]: the outcome's all-reduce below
            self.strategy.agreement.agree("load_module_state_dict", "an all-reduce of the load's outcome")
        try:
            with GatheredParameters(list(self.module.parameters()), modifier_rank=0):  # stages 0-2: nothing to gather
                failed: Exception | None = None
                try:
                    if custom_load_fn is not None:
                        custom_load_fn(src=state, dst=self.module)
                    else:
                        result = self.module.load_state_dict(state, strict=False)
                        missing = set(result.missing_keys) - set(allowed_missing_keys or ())
                        if strict and (missing or result.unexpected_keys):
                            raise ZeroshardError(
                                f"load_module_state_dict: missing keys {sorted(missing)}, unexpected keys "
                                f"{sorted(result.unexpected_keys)} (strict=False loads the matching ones)"
                            )
                except Exception as err:  # noqa: BLE001 - raised below, once every rank knows
                    failed = err
                _raise_if_any_failed(self.strategy, failed)  # raised inside on every rank: no broadcast anywhere
        except BaseException:
            if self.strategy is not None:
                self.strategy.discard_module_changes()
            raise
        if self.strategy is not None:
            self.strategy.take_module_params(src=0)

    # -- [Note: generation at stage 3] ---------------------------------------------------------------------
    def _own_generate(self) -> Callable[..., Any] | None:
        from zeroshard.generation import own_generate

        return own_generate(self.module)

    def _generate_kwargs(self, own: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """[Note: generation at stage 3] `synced_gpus=True` by default where every forward communicates."""
        from zeroshard.generation import synced

        return synced(self.module, own, kwargs) if self.forward_communicates() else kwargs

    def forward_communicates(self) -> bool:
        """Whether each forward is collective across ranks: stage 3 gathers, experts split over ranks exchange
        tokens ([Note: generation at stage 3])."""
        from zeroshard.moe.zero import moe_layers

        split = any(layer.ep_size > 1 for layer in moe_layers(self.module))
        return self.world_size > 1 and (self.zero_stage == 3 or split)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's `generate`, with `synced_gpus=True` by default at stage 3 or with experts split over ranks, on
        several ranks (every rank must call it there, as under DeepSpeed ZeRO-3)."""
        if self.strategy is not None:  # [Note: offloaded states]
            self.strategy.refuse_away("generate", (PARAMS,))
        own = self._own_generate()
        if own is None:
            raise ZeroshardError(f"{type(self.module).__name__} has no generate()")
        return own(*inputs, **self._generate_kwargs(own, kwargs))

    # -- [Note: coalesced gradient reduction] ----------------------------------------------------------------
    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """The backwards inside the block keep their gradients on this rank; leaving it reduces them once (every
        rank must leave it). Then `engine.step()`, outside the block. Stages 1-3, managed accumulation, as
        DeepSpeed 0.19."""
        strategy = self._require_optimizer("coalesce_grad_reduction")
        refused = None
        if not self.accumulation.managed:
            refused = "managed_gradient_accumulation is false: the script's own windows already decide the reduction"
        elif self.zero_stage == 0:
            refused = "ZeRO stage 0 (DeepSpeed refuses it too); use no_sync() there"
        elif type(self).__name__ == "PipelineEngine":
            refused = "a PipelineModule (train_batch runs the whole window)"
        elif self.accumulation.no_sync_depth or self.accumulation.coalescing:
            refused = "inside no_sync() or another coalesce_grad_reduction() block"
        else:
            refused = strategy.coalescing_refused()
        if refused is not None:
            raise ZeroshardError(f"coalesce_grad_reduction is not supported here: {refused}")
        self.accumulation.coalescing = True
        try:
            yield
        except BaseException:
            strategy.zero_grad()  # the block failed: its held gradients are dropped, not reduced (still coalescing)
            self.accumulation.coalescing = False
            raise
        self.accumulation.coalescing = False
        with self._deadline("coalesce_grad_reduction"):
            strategy.flush_coalesced()

    # -- a backward the script runs itself ([Note: a backward the engine did not start]) -------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale (unchanged without fp16), for the script's own `.backward()`:
        `engine.scale(loss).backward(); engine.step()`."""
        self._require_optimizer("scale")
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise ZeroshardError("engine.scale(loss): the loss must be a scalar tensor that requires grad")
        self._manual.scaled = True
        return loss * self.loss_scale if self.loss_scaler is not None else loss

    def _manual_backward_begins(self) -> None:
        """What `engine.backward` does before `loss.backward()`, for a backward the script started."""
        strategy = self._require_optimizer("backward")
        strategy.refuse_away("loss.backward()", (PARAMS, GRADS))
        self._refuse_unfinished("loss.backward()")
        if self._compute is not contextlib.nullcontext:
            raise ZeroshardError(
                "loss.backward() with tensor parallelism's vocab-parallel loss: its backward must run inside "
                "loss_parallel(), which engine.backward enters; call engine.backward(loss)"
            )
        if strategy.steps_in_backward and self.is_gradient_accumulation_boundary():
            self.commit_checkpoint()  # super_offload steps during this backward
        strategy.begin_backward()
        self.accumulation.loss_scale = self.loss_scale
        self.accumulation.unfinished = True  # until autograd's callback below ends it

    def _manual_backward_ends(self) -> None:
        """What `engine.backward` does after `loss.backward()` (autograd calls it when the backward is done)."""
        self.accumulation.unfinished = False  # autograd ended; what finish_backward raises says itself
        self._require_optimizer("backward").finish_backward()
        self.accumulation.pending = True
        self.accumulation.window_backwards += 1

    def _refuse_unfinished(self, call: str) -> None:
        """[Note: a backward that raised]
        A backward that raises part way (an out-of-memory error on a long batch, an error in a hook) has reduced
        some buckets of the window's gradients and not others, and where it stopped differs by stage: going on
        from there counted the reduced part twice (stage 0), dropped it (stages 1-2 with one micro-step) or mixed
        it into a sum of no rule (stage 1 with accumulation). The next backward or step is refused until
        `engine.zero_grad()` drops the window's gradients, after which training goes on exactly as if the batch
        had been skipped (DeepSpeed's stage 2 fails there with "has already been reduced"), where every rank's
        backward raised alike ([Note: a backward that raised on some ranks])."""
        if self.accumulation.unfinished:
            raise ZeroshardError(
                f"{call}: the previous backward raised before it ended, so this window's gradients hold part of it; "
                "call engine.zero_grad() to drop them (as after an out-of-memory error on a batch), then go on"
            )

    def _settle_raised(self, call: str) -> None:
        """Before a backward that raised is dropped: did every rank's raise, at the same point? ([Note: a backward
        that raised on some ranks])"""
        if self.accumulation.unfinished:
            configured = float(self.config.zeroshard.collective_timeout_s)
            raised_on_every_rank(self.comm, call, group_timeout_s(self.comm, configured))

    def offload_states(
        self,
        include: Any = None,
        device: Any = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move model states off the device until `reload_states()` (DeepSpeed's API; [Note: offloaded states]):
        `include` names DeepSpeed's kinds (`OffloadStateTypeEnum`: optim_states, hp_params, lp_params, lp_grads,
        contiguous_grad_buffer; None: all), `device` is "cpu" (`OffloadDeviceEnum.none` moves nothing). Training
        steps, checkpoint loads, and the calls that read or write model states (`safe_get_full_*`, the setters,
        `GatherParameters(modifier_rank=...)`) are refused in between; with lp_params, forwards too. A checkpoint
        save brings the states back for itself and moves them out again. State that lives off the device already
        (`offload_optimizer`, `offload_param`) stays where it is."""
        strategy = self._require_optimizer("offload_states")
        kinds = offload_kinds(include)
        target = offload_device(device)
        if target is None:
            logger.warning("offload_states(device='none'): no device given, nothing moves (as DeepSpeed)")
            return
        why = strategy.offload_refused(kinds)
        if why is not None:
            raise ZeroshardError(f"offload_states(include={list(kinds)}): refused {why}")
        self.commit_checkpoint()
        if PARAMS in kinds:
            strategy.release_gathered()  # DeepSpeed's empty_partition_cache first
        on_device = {k: [t for t in ts if t.device == self.device] for k, ts in strategy.offloadable().items()}
        moved = self._offloader.offload(on_device, kinds, target, pin_memory, non_blocking)
        if BUFFERS in kinds:
            strategy.release_buffers()
        if PARAMS in moved:
            strategy.show_params(away=True, host_view=self._offloader.host_view)
        strategy.offloaded = strategy.offloaded | moved
        _return_to_device(self.device)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states()` moved."""
        self._offloader.reload(non_blocking)
        if self.strategy is not None:
            if PARAMS in self.strategy.offloaded:
                self.strategy.show_params(away=False)
            self.strategy.offloaded = frozenset()

    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter, persistent ones too (they are gathered again when next used),
        and return the freed memory to the device: what DeepSpeed's does before a model is set aside (an RL loop
        moving between models). Other stages hold nothing gathered; the call only collects garbage there."""
        if self.strategy is not None:
            self.strategy.release_gathered()
        gc.collect()
        from zeroshard.accelerator import get_accelerator

        get_accelerator().empty_cache()

    # -- data --------------------------------------------------------------------------------------------
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, IterableDataset)

    def deepspeed_io(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
    ) -> DataLoader[Any]:
        """A dataloader over this data-parallel replica's share of `dataset`, `batch_size` (default: the
        micro-batch) samples at a time: the training route shuffles as `initialize`'s loader does (a pipeline's
        reads in order, as its own loader), eval and predict read in order; `data_sampler` replaces the sampler.
        Only `initialize`'s own loader has its position saved in checkpoints."""
        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ZeroshardError("deepspeed_io: the data must be a torch Dataset (map-style or iterable)")
        size = int(batch_size or self.config.train_micro_batch_size_per_gpu)
        collate = collate_fn if collate_fn is not None else getattr(self, "collate_fn", None)
        rank, replicas = self.data_replica[:2] if self.data_replica is not None else (self.global_rank, self.world_size)
        drop_last = bool(self.config.dataloader_drop_last)
        workers = 2 if num_local_io_workers is None else num_local_io_workers  # DeepSpeed's default
        pin = pin_memory and torch.cuda.is_available()
        shuffle = route == "train" and (self.data_replica is None or self.data_replica[2])
        if data_sampler is None and shuffle and not self.is_iterable_style_dataset(dataset):
            from zeroshard.data import build_dataloader

            return build_dataloader(
                dataset, size, rank, replicas, collate, drop_last=drop_last, num_workers=workers, pin_memory=pin
            )
        if data_sampler is None and not self.is_iterable_style_dataset(dataset):
            data_sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)
        return DataLoader(
            dataset,
            batch_size=size,
            sampler=data_sampler,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=pin,
            drop_last=drop_last,
        )


def _raise_if_any_failed(strategy: Any, failed: Exception | None) -> None:
    """Every rank learns which ranks' module load failed (one all-reduce) and, if any did, raises inside the
    `GatheredParameters` block: no rank then broadcasts rank 0's values while another restores its own."""
    if strategy is None or strategy.comm.world_size == 1:
        if failed is not None:
            raise failed
        return
    flags = torch.zeros(strategy.comm.world_size, device=strategy.device)
    flags[strategy.comm.rank] = float(failed is not None)
    strategy.comm.all_reduce(flags, label="load_module_state_dict outcome")
    ranks = [r for r, flag in enumerate(flags.tolist()) if flag]
    if failed is not None:
        raise failed
    if ranks:
        raise ZeroshardError(
            f"load_module_state_dict failed on rank(s) {ranks} (their error says why); nothing was taken from rank 0"
        )


def _return_to_device(device: torch.device) -> None:
    """The caching allocator's freed blocks go back to the driver, where another process can use them (an inference
    engine beside an RL loop's trainer); a no-op on the CPU."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
