"""`CheckpointMixin`: DeepSpeed's `save_checkpoint` / `load_checkpoint` methods for the Engine."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint import load as _load
from zeroshard.checkpoint import save as _save
from zeroshard.checkpoint.decoupled import PendingSave, decoupled, failing
from zeroshard.checkpoint.torn import TornLoad, refuse_torn
from zeroshard.errors import ZeroshardError
from zeroshard.linear.engine import checkpoint_excludes_frozen
from zeroshard.offload.states import StateOffloader
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


class CheckpointMixin:
    """Adds `save_checkpoint` and `load_checkpoint` to the engine (`class Engine(CheckpointMixin, nn.Module)`).

    Both are collective: call them on every rank. A call on some ranks only raises a `CheckpointError`
    naming the missing ranks instead of hanging: within seconds when they went on training
    (`ZEROSHARD_CHECKPOINT_GRACE`, default 5), else after `ZEROSHARD_CHECKPOINT_TIMEOUT` (default 300).

    Example:
        >>> engine.save_checkpoint("ckpt", client_state={"epoch": 3})  # doctest: +SKIP
        >>> path, client_state = engine.load_checkpoint("ckpt")  # doctest: +SKIP
        >>> client_state["epoch"]  # doctest: +SKIP
        3
    """

    _pending_save: PendingSave | None = None  # a decoupled save between its call and its commit
    _checkpoint_stream: torch.cuda.Stream | None = None
    # pipeline engines: each stage saves its own folder, the call ends with every stage ([Note: pipeline checkpoints])
    _saves_per_stage = False
    # where the engine's first checkpoint rendezvous keys are (a pipeline's world calls: pipe/checkpoint.py)
    _checkpoint_prefix = ""
    _torn_load: TornLoad | None = None  # a load that failed part way: [Note: a torn load]
    _offloader: StateOffloader  # the engine's offload_states() (set by Engine)
    strategy: Any  # Engine's Strategy (None after destroy)

    if TYPE_CHECKING:  # DeepSpeedCalls'

        def offload_states(
            self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
        ) -> None: ...

        def reload_states(self, non_blocking: bool = False) -> None: ...

        def _settle_raised(self, call: str) -> None: ...

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save model weights, optimizer/master state, scheduler, loss scaler, counters, RNG and sampler.

        Args:
            save_dir: directory holding the tagged checkpoints and `latest`.
            tag: checkpoint name (default `global_step{global_steps}`); the same on every rank.
            client_state: picklable dict returned by `load_checkpoint`.
            save_latest: point `latest` at this checkpoint once it is complete.
            exclude_frozen_parameters: leave out parameters with `requires_grad=False`.
        Returns True. Writes are crash-safe: see docs/checkpoint.md. With `checkpoint.writer.decoupled` it returns
        once the ranks agreed, writes on a thread and commits at the next optimizer step ([Note: decoupled
        checkpoint writes]).
        """
        refuse_torn(self, "save_checkpoint")
        # [Note: sharded base weights]: rank-local shards are never written
        exclude_frozen_parameters = checkpoint_excludes_frozen(self.module, exclude_frozen_parameters)  # type: ignore[attr-defined]
        with self._states_back("save_checkpoint"):
            self.commit_checkpoint("save_checkpoint")
            deferred = decoupled(self)
            call = _save.start_save(
                self,  # type: ignore[arg-type]
                save_dir,
                tag,
                dict(client_state or {}),
                save_latest,
                exclude_frozen_parameters,
                deferred,
            )
            if not deferred:
                return _save.finish_save(call)
            self._pending_save = PendingSave(call, self._writer_stream())
            return True

    @contextlib.contextmanager
    def _states_back(self, op: str) -> Iterator[None]:
        """DeepSpeed's save reads the host copies `offload_states()` made (its states are CPU tensors then); here the
        moved storages are empty, so the states come back to the device for the save and move out again after it,
        which waits for a decoupled save's writes first ([Note: offloaded states]). A failed save leaves them back;
        a save where they could not move out again (inside stage 3's GatheredParameters) is refused first."""
        if not self._offloader.active:
            yield
            return
        kinds, pinned = sorted(self._offloader.kinds), self._offloader.pinned
        why = self.strategy.offload_refused(kinds) if self.strategy is not None else None
        if why is not None:
            raise ZeroshardError(
                f"{op}: {', '.join(kinds)} offloaded by offload_states() would come back for it and could not move "
                f"out again {why}; call engine.reload_states() first"
            )
        log_rank(logger, logging.INFO, f"{op}: {', '.join(kinds)} back from offload_states() for it, then out again")
        self.reload_states()
        yield
        self.offload_states(include=kinds, pin_memory=pinned)

    def _refuse_offloaded(self, op: str) -> None:
        """The states `offload_states()` moved out are empty storages here until `reload_states()`."""
        if self._offloader.active:
            kinds = ", ".join(sorted(self._offloader.host_bytes()))
            raise ZeroshardError(f"{op}: {kinds} offloaded by offload_states(); call engine.reload_states() first")

    def _writer_stream(self) -> torch.cuda.Stream | None:
        """The engine's one CUDA stream for its writer thread's copies (a stream from torch's shared pool could be
        one the strategy copies on)."""
        device: torch.device = self.device  # type: ignore[attr-defined]
        if device.type != "cuda":
            return None
        if self._checkpoint_stream is None:
            self._checkpoint_stream = torch.cuda.Stream(device)
        return self._checkpoint_stream

    def commit_checkpoint(self, op: str = "commit_checkpoint") -> bool:
        """Finish the decoupled save in flight, if any (collective): wait for this rank's writes, commit on every
        rank, raise what failed on any. The engine calls it at the next optimizer step, save, load,
        offload_states and destroy, and at exit; False when there was none. A rank that is failing gives it up
        instead (`destroy()` inside an exception), so the others learn it at once rather than waiting."""
        pending = self._pending_save
        if pending is None:
            return False
        self._pending_save = None
        if op == "destroy" and failing(pending.during):
            pending.abandon("the engine was destroyed while an exception was raised")
            return False
        return pending.commit(op)

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved with any world size and ZeRO stage; returns `(path, client_state)`.

        Args:
            load_dir: the `save_dir` of `save_checkpoint`.
            tag: checkpoint name; default: the one `latest` names. `(None, None)` when there is no `latest`.
            load_module_strict: the module's keys must match the checkpoint's exactly.
            load_optimizer_states: restore master weights, optimizer state and the loss scaler (else the
                master weights are rebuilt from the loaded module weights).
            load_lr_scheduler_states: restore the lr scheduler.
            load_module_only: restore the module weights only (warm start).
            custom_load_fn: `f(src=state_dict, dst=module)` loads the module weights instead of their names
                ([Note: custom_load_fn] in checkpoint/custom_load.py).
        """
        self._refuse_offloaded("load_checkpoint")
        self._settle_raised("load_checkpoint")  # [Note: a backward that raised on some ranks]
        self.commit_checkpoint("load_checkpoint")
        return _load.load_checkpoint(
            self,  # type: ignore[arg-type]
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn=custom_load_fn,
        )
