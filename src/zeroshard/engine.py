"""The training engine: forward, backward and step over a ZeRO strategy, with DeepSpeed's API."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.engine_mixin import CheckpointMixin
from zeroshard.checkpoint.torn import refuse_torn
from zeroshard.checkpoint.watch import AbsenceWatch, Activity
from zeroshard.comm.collectives import Collectives
from zeroshard.comm.divergence import named_on_timeout
from zeroshard.comm.topology import Topology
from zeroshard.engine_accessors import EngineAccessors
from zeroshard.engine_calls import DeepSpeedCalls
from zeroshard.engine_optimizer import engine_optimizer
from zeroshard.engine_weights import WholeModelCalls
from zeroshard.errors import ZeroshardError
from zeroshard.generation import uninstall as uninstall_generate
from zeroshard.manual_backward import ENGINE_BACKWARDS, ManualBackward
from zeroshard.memory import ProcessMemory, StrategyMemory, process_memory
from zeroshard.monitor import Monitor, Telemetry, open_monitors
from zeroshard.monitor.throughput import ThroughputTimer
from zeroshard.monitor.wall_clock import WallClock
from zeroshard.offload.states import GRADS, PARAMS, StateOffloader
from zeroshard.optim.schedulers.base import step_scheduler
from zeroshard.precision.cast import inputs_to_half
from zeroshard.precision.policy import PrecisionPolicy
from zeroshard.runtime.python_gc import PYTHON_GC
from zeroshard.runtime.schedules import TrainingSchedules
from zeroshard.runtime.utils import see_memory_usage
from zeroshard.utils import groups as parallel_groups
from zeroshard.utils.logging import get_logger, log_rank, print_configuration, set_log_level_from_string
from zeroshard.zero.strategy import AccumulationState, Strategy

logger = get_logger(__name__)
MiB = 1 << 20


@dataclass
class MemoryReport(StrategyMemory, ProcessMemory):
    """Bytes held by this rank, by kind (the strategy's columns, `StrategyMemory`, plus who and what), next to the
    process's resident set and its peak as the OS counts them (`ProcessMemory`; on CUDA also the caching
    allocator's). `model_states` is the sum ZeRO's formulas describe, as held now: stage 3 holds frozen parameters
    as shards in `params`, and its gradient shards only from an accumulation window's first reduction to the step
    (read after a step, `gradients` is 0 there: [Note: gradient shards exist from reduction to step]). `summary()` is
    the one-line form the trainer and the examples print."""

    rank: int = 0
    world_size: int = 1
    stage: int = 0
    trainable_numel: int = 0
    frozen_params: int = 0
    offload_spare: int = 0  # pinned host buffers offload_states() keeps for its next offload (CUDA)

    @property
    def model_states(self) -> int:
        return self.params + self.frozen_params + self.gradients + self.master_weights + self.optimizer_state

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "model_states": self.model_states}

    def summary(self) -> str:
        """E.g. "model states 193.0 MiB/rank (stage 3), gathered 12.0 MiB, comm buffers 0.0 MiB; process RSS 518
        MiB, peak 676 MiB" (and the CUDA allocator's bytes on CUDA)."""
        line = (
            f"model states {self.model_states / MiB:.1f} MiB/rank (stage {self.stage}), gathered "
            f"{self.gathered_params / MiB:.1f} MiB, comm buffers {self.comm_buffers / MiB:.1f} MiB; process RSS "
            f"{self.process_rss / MiB:.0f} MiB, peak {self.process_peak_rss / MiB:.0f} MiB"
        )
        if self.device_peak_allocated:
            allocated, peak = self.device_allocated / MiB, self.device_peak_allocated / MiB
            line += f"; CUDA allocated {allocated:.0f} MiB, peak {peak:.0f} MiB"
        return line


class Engine(CheckpointMixin, DeepSpeedCalls, WholeModelCalls, EngineAccessors, nn.Module):
    """What `zeroshard.initialize` returns first. `engine(batch)`, `engine.backward(loss)`, `engine.step()`.

    Example:
        >>> engine, optimizer, loader, sched = zeroshard.initialize(model=model, config=cfg)  # doctest: +SKIP
        >>> loss = engine(x, y); engine.backward(loss); engine.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        module: nn.Module,
        config: Any,
        topology: Topology,
        comm: Collectives,
        precision: PrecisionPolicy,
        strategy: Strategy | None,
        accumulation: AccumulationState,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
        loss_scaler: Any,
        training_dataloader: Any,
        compute_context: Callable[[], AbstractContextManager[Any]] | None = None,
        monitors: list[Monitor] | None = None,
    ):
        """`compute_context`: entered around every forward and backward (tensor parallelism's vocab-parallel loss,
        [Note: vocab-parallel loss] in tp/plan.py). `monitors`: what `initialize` opened on rank 0 ([Note: monitors
        open first]); None opens them here."""
        super().__init__()
        if config.log_level is not None:
            set_log_level_from_string(config.log_level)
        self.module = module
        self.config = config
        self.topology = topology
        self.comm = comm
        self.precision = precision
        self.strategy = strategy
        self.accumulation = accumulation  # shared with the strategy: [Note: strategy contract]
        self.basic_optimizer = optimizer  # the torch optimizer; engine.optimizer: [Note: the engine's optimizer]
        self.optimizer = engine_optimizer(self, optimizer)
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.training_dataloader = training_dataloader
        self._compute = compute_context or contextlib.nullcontext
        self.first_forward_hooks: list[Any] = []  # one-shot checks on the module, removed at destroy if never run
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._last_grad_norm: float | None = None
        self._step_applied = False
        self.last_step_overflowed = False  # engine.optimizer.overflow
        self._offloader = StateOffloader()
        self._activity = Activity()  # [Note: one-rank checkpoint calls]
        self._watch = AbsenceWatch.start(self._activity, topology, self._checkpoint_prefix)
        if self._watch is not None:
            weakref.finalize(self, self._watch.stop)
        if monitors is None:
            monitors = open_monitors(config, comm, topology.rank, topology.device)
        self.telemetry = Telemetry.from_config(config, module, topology.rank, topology.world_size, strategy, monitors)
        self.wall_clock = WallClock(self.wall_clock_breakdown(), topology.device)  # (with the flops profiler too)
        self.schedules = TrainingSchedules.from_config(config)
        # DeepSpeed's attribute names, which scripts read (Megatron-DeepSpeed: the legacy curriculum)
        self.progressive_layer_drop = self.schedules.pld
        self.curriculum_scheduler_legacy = self.schedules.curriculum
        throughput = config.timers.throughput
        self.tput_timer = ThroughputTimer(  # [Note: throughput timer]
            bool(throughput.enabled),
            bool(throughput.synchronized),
            self.train_batch_size(),
            config.steps_per_print,
            loader=training_dataloader,
            whole_windows=not self.accumulation.managed,
        )
        self._memory_breakdown = bool(config.memory_breakdown)
        self._auto_cast = bool(config.fp16.auto_cast)
        # torch_autocast ([Note: torch autocast]), or beside bf16.enabled (the bf16 model's forward, as DeepSpeed)
        self._autocast_dtype = precision.autocast_dtype or precision.forward_autocast
        self._warned_outer_autocast = False
        self._compiled: dict[str, Any] | None = None  # engine.compile()'s arguments once it ran
        self._manual = ManualBackward(  # [Note: a backward the engine did not start]
            self._manual_backward_begins,
            self._manual_backward_ends,
            self.gradient_accumulation_steps,
            loss_scaler is not None,
        )
        if config.disable_python_gc:  # [Note: python gc per process]
            self._gc_release = weakref.finalize(self, PYTHON_GC.release, PYTHON_GC.acquire())
        if config.dump_state:
            print_configuration(self, "Engine")

    @property
    def micro_steps(self) -> int:
        return self.accumulation.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:  # checkpoint load restores it
        self.accumulation.micro_steps = value

    # -- the loop ----------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_torn(self, "forward")
        if self.strategy is not None:  # [Note: offloaded states]; a forward that can be back-propagated needs both
            self.strategy.refuse_away("engine.forward", (PARAMS, GRADS) if torch.is_grad_enabled() else (PARAMS,))
        if self.module.training:  # [Note: progressive layer drop], [Note: legacy curriculum learning]
            kwargs.update(self.schedules.forward_kwargs(self.global_steps))
        if self._auto_cast:
            args = inputs_to_half(args)
        self.tput_timer.start()
        see_memory_usage("Engine before forward", force=self._memory_breakdown)
        with self._deadline("engine.forward"), self.telemetry.forward(self.global_steps):  # stage 3 gathers here
            with self._compute(), self.wall_clock.time("fwd"), self._autocast():
                out = self.module(*args, **kwargs)
        if self.strategy is not None:
            self._manual.watch(out)
        see_memory_usage("Engine after forward", force=self._memory_breakdown)
        return out

    def _autocast(self) -> AbstractContextManager[Any]:
        """torch_autocast's forward context, replacing one the caller entered; without torch_autocast a caller's
        autocast is switched off inside the engine (its precision is the config's), as DeepSpeed's engine does."""
        device = self.device.type
        if self._autocast_dtype is not None:
            return torch.autocast(device_type=device, dtype=self._autocast_dtype)
        if torch.is_autocast_enabled(device):
            if not self._warned_outer_autocast:
                self._warned_outer_autocast = True
                log_rank(
                    logger,
                    30,
                    "zeroshard: torch.autocast is on around the engine but torch_autocast is not configured: the "
                    "engine's forward runs without it (its precision is the bf16/fp16 block's); configure the "
                    "torch_autocast block to use torch's autocast",
                )
            return torch.autocast(device_type=device, enabled=False)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _deadline(self, what: str) -> Iterator[None]:
        """An engine call that communicates: its collectives have the deadline, and it is the activity a rank
        that skipped a checkpoint call is found in ([Note: one-rank checkpoint calls])."""
        timeout = float(self.config.zeroshard.collective_timeout_s)
        with (
            named_on_timeout(self.comm, f"{what} (step {self.global_steps})", timeout),
            self._activity.call(what, self.global_steps),
        ):
            yield

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Back-propagate `loss / gradient_accumulation_steps` (times the fp16 loss scale), which is returned (without
        the loss scale), as DeepSpeed's; with `scale_wrt_gas=False` (DeepSpeed's argument) the caller has already
        divided the loss."""
        strategy = self._require_optimizer("backward")
        strategy.refuse_away("engine.backward", (PARAMS, GRADS))
        self._refuse_unfinished("engine.backward")
        if strategy.steps_in_backward and self.is_gradient_accumulation_boundary():
            self.commit_checkpoint()  # super_offload steps during this backward
        see_memory_usage("Engine before backward", force=self._memory_breakdown)
        with self.wall_clock.time("bwd"):
            strategy.begin_backward()
            self.accumulation.loss_scale = self.loss_scale
            self.accumulation.unfinished = True  # [Note: a backward that raised]
            factor = self.loss_scale / (self.gradient_accumulation_steps() if scale_wrt_gas else 1)
            with self._deadline("engine.backward"), torch.profiler.record_function("zeroshard.backward"):
                scaled = loss * factor  # a root of its own: [Note: a backward the engine did not start]
                with self._compute(), self.wall_clock.time("bwd_inner"), ENGINE_BACKWARDS.running(scaled):
                    self._manual.engine_backwards += 1
                    try:
                        scaled.backward(retain_graph=retain_graph)
                    finally:
                        self._manual.engine_backwards -= 1
            self.accumulation.unfinished = False  # autograd ended; what finish_backward raises says itself
            with self._deadline("engine.backward"), torch.profiler.record_function("zeroshard.reduce_wait"):
                with self.wall_clock.time("bwd_allreduce"):
                    strategy.finish_backward()
        self.accumulation.pending = True
        self.accumulation.window_backwards += 1
        self.telemetry.after_backward(loss, self.is_gradient_accumulation_boundary(), self.global_samples)
        see_memory_usage("Engine after backward", force=self._memory_breakdown)
        gas = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        return loss / gas if gas != 1 else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count a micro-step; on the accumulation boundary take the optimizer step on every rank (on every call when
        `managed_gradient_accumulation` is false: [Note: caller-owned windows]). `lr_kwargs` go to the scheduler's
        `step` (DeepSpeed's; Megatron-DeepSpeed passes `{"increment": n}`)."""
        strategy = self._require_optimizer("step")
        self._refuse_unfinished("engine.step")
        if self._offloader.active:
            self._refuse_offloaded("engine.step")
        if self.accumulation.coalescing:  # as DeepSpeed
            raise ZeroshardError("engine.step() inside coalesce_grad_reduction(); leave the block first")
        with self.accumulation.inside_step():
            boundary = self.is_gradient_accumulation_boundary()
            see_memory_usage("Engine before step", force=self._memory_breakdown)
            samples = self.global_samples
            with self.wall_clock.time("step"):
                self._step(strategy, boundary, lr_kwargs)
            self.tput_timer.stop(boundary, self.global_rank == 0, self.global_samples - samples)
            self.wall_clock.after_step(boundary, self.global_samples, self.telemetry.write_events)
            if boundary:  # after the wall clock: its times of this step go into the profile
                self.telemetry.profile_report(self.global_steps - 1, self.wall_clock.snapshot())
        see_memory_usage("Engine after step", force=self._memory_breakdown)
        self.accumulation.micro_steps += 1

    def _step(self, strategy: Strategy, boundary: bool, lr_kwargs: dict[str, Any] | None = None) -> None:
        self._step_applied = False
        if boundary:
            if self.accumulation.no_sync_depth:
                raise ZeroshardError("engine.step() on an accumulation boundary inside no_sync(); leave no_sync first")
            self.commit_checkpoint()  # before the step changes what a decoupled save writes
            self.schedules.before_step(self.global_steps)
            if not self.accumulation.managed:
                self.telemetry.window_loss(self.global_samples)
            with self._deadline("engine.step"):
                if not self.accumulation.managed:
                    strategy.end_window()
                outcome = strategy.step(self.loss_scale)
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(outcome.skipped)
            if outcome.skipped:
                self.skipped_steps += 1
                log_rank(
                    logger,
                    20,
                    f"step {self.global_steps}: inf/nan gradients, step skipped; loss scale now {self.loss_scale:g}",
                )
            elif self.lr_scheduler is not None:
                step_scheduler(self.lr_scheduler, lr_kwargs, self.train_batch_size())
            self._last_grad_norm = outcome.grad_norm
            self._step_applied = not outcome.skipped
            self.last_step_overflowed = outcome.skipped
            self.global_steps += 1
            self.global_samples += self.accumulation.after_step(self.train_batch_size())
            self._report_progress()
            scale = self.loss_scale if self.loss_scaler is not None else None
            self.telemetry.after_step(self.global_steps - 1, self.global_samples, self.get_lr()[0], scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients accumulated since the last step (they live in flat buffers, never in .grad)."""
        if self.strategy is not None:
            self.strategy.refuse_away("engine.zero_grad", (GRADS,))  # [Note: offloaded states]
            self._settle_raised("engine.zero_grad")
            self.strategy.zero_grad()
        self.accumulation.pending = self.accumulation.unfinished = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's override of where accumulation windows end (accelerate sets it before every backward): the
        micro-steps after it are boundaries exactly when `is_boundary`, whatever the micro-step count says."""
        if not self.accumulation.managed:  # as DeepSpeed refuses it
            raise ZeroshardError(
                "set_gradient_accumulation_boundary() with managed_gradient_accumulation false: every engine.step() "
                "ends a window; call step() where the window ends instead"
            )
        self.accumulation.boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without communication (stages 0 and 1, like DDP's no_sync)."""
        if self.zero_stage >= 2:
            raise ZeroshardError(
                f"no_sync() is incompatible with ZeRO stage {self.zero_stage}: gradients are partitioned "
                "(reduce-scattered) every micro-step. Use stage 0/1, or rely on gradient_accumulation_steps."
            )
        if self.accumulation.coalescing:  # [Note: coalesced gradient reduction]: DeepSpeed refuses the nesting too
            raise ZeroshardError("no_sync() inside coalesce_grad_reduction(): the block already holds the reduction")
        self.accumulation.no_sync_depth += 1
        try:
            yield
        finally:
            self.accumulation.no_sync_depth -= 1

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[None]:
        """Keep the whole model gathered inside the block (stage 3), e.g. for `model.generate(...)`,
        so generation does not all-gather every layer for every token. Every rank must enter it."""
        if self.strategy is None:
            yield
            return
        with self.strategy.gathered():
            yield

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """`torch.compile` the module in place (`nn.Module.compile`), as DeepSpeed's `engine.compile()`: `backend`
        defaults to `get_accelerator().get_compile_backend()` ("inductor"), `compile_kwargs` go to torch.compile
        (`mode`, `dynamic`, `fullgraph`, ...). Every stage and both backends; stage 3's gathering hooks run eagerly
        between compiled units ([Note: hooks under torch.compile]). A second call does nothing. `schedule` is
        DeepCompile's, which is not provided: ignored, as DeepSpeed ignores it without DeepCompile. Compiled autograd
        is refused: gradients are reduced by hooks that run during backward.

        Example:
            >>> engine.compile(backend="inductor", compile_kwargs={"mode": "max-autotune"})  # doctest: +SKIP
        """
        if compiled_autograd_enabled:
            raise ZeroshardError(
                "engine.compile(): compiled_autograd_enabled=True is not provided (zeroshard reduces gradients from "
                "hooks during backward, which run eagerly); call engine.compile(backend=..., compile_kwargs=...)"
            )
        if self._compiled is not None:
            return
        from zeroshard.accelerator import get_accelerator

        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning("zeroshard: engine.compile(): `backend` in compile_kwargs is overridden by the argument")
        kwargs["backend"] = backend or get_accelerator().get_compile_backend()
        log_rank(logger, 20, f"zeroshard: compiling the module with torch.compile({kwargs})")
        self.module.compile(**kwargs)
        self._compiled = kwargs

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` ran."""
        return self._compiled is not None

    def collect_python_gc(self) -> int:
        """Run Python's cyclic collector now (with `disable_python_gc`, at a point the script chooses); returns
        what it collected."""
        import gc

        return gc.collect()

    def destroy(self) -> None:
        """Remove every hook from the module and release optimizer state and buffers."""
        self.commit_checkpoint("destroy")
        if self._offloader.active:  # the module is left whole and usable ([Note: offloaded states])
            self.reload_states()
        self._offloader.release()
        release = getattr(self, "_gc_release", None)
        if release is not None:
            release()  # [Note: python gc per process]
        if self._watch is not None:
            self._watch.stop()
        parallel_groups.withdraw(self.comm)  # [Note: groups follow the engine]
        uninstall_generate(self)  # [Note: generation at stage 3]
        for handle in self.first_forward_hooks:
            handle.remove()
        if self.strategy is not None:
            self.strategy.destroy()
            self.strategy = None
        self.telemetry.close()
        if self.basic_optimizer is not None:
            self.basic_optimizer.state.clear()
        self.optimizer = self.basic_optimizer = None
        self.lr_scheduler = None

    # -- reporting ---------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        memory = self.strategy.memory() if self.strategy is not None else StrategyMemory()
        tracked = {id(p) for p in self.strategy.tracked_params()} if self.strategy is not None else set()
        # stage 3 holds frozen parameters as shards inside `params`
        frozen = sum(p.numel() * p.element_size() for p in self.module.parameters() if id(p) not in tracked)
        # the strategies count what the device holds now; offload_states()'s host copies go in the host columns
        moved = self._offloader.host_bytes()
        memory.host_optimizer_state += moved.get("optim_states", 0)
        memory.host_master_weights += moved.get("hp_params", 0)
        memory.host_params += moved.get(PARAMS, 0)
        memory.host_gradients += moved.get(GRADS, 0)
        return MemoryReport(
            rank=self.global_rank,
            world_size=self.world_size,
            stage=self.zero_stage,
            trainable_numel=self.strategy.trainable_numel if self.strategy is not None else 0,
            frozen_params=frozen,
            offload_spare=self._offloader.spare_bytes,
            **memory.as_dict(),
            **asdict(process_memory(self.device)),
        )

    def _report_progress(self) -> None:
        every = int(self.config.steps_per_print or 0)
        if every > 0 and self.global_steps % every == 0:
            # DeepSpeed's line first (log parsers read it), then ours
            log_rank(
                logger,
                20,
                f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}, "
                f"grad_norm={self._last_grad_norm}, loss_scale={self.loss_scale:g}",
            )

    def _require_optimizer(self, what: str) -> Strategy:
        refuse_torn(self, what)
        if self.strategy is None or self.basic_optimizer is None:
            raise ZeroshardError(
                f'engine.{what}() needs an optimizer: pass optimizer= to initialize or add an "optimizer" '
                "block to the config (or the engine was destroyed)"
            )
        return self.strategy
