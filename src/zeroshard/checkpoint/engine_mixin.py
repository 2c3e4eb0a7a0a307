"""`CheckpointMixin`: DeepSpeed's `save_checkpoint` / `load_checkpoint` methods for the Engine."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from zeroshard.checkpoint import load as _load
from zeroshard.checkpoint import save as _save


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
        Returns True. Writes are crash-safe: see docs/checkpoint.md.
        """
        return _save.save_checkpoint(
            self,  # type: ignore[arg-type]
            save_dir,
            tag,
            dict(client_state or {}),
            save_latest,
            exclude_frozen_parameters,
        )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
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
        """
        return _load.load_checkpoint(
            self,  # type: ignore[arg-type]
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )
