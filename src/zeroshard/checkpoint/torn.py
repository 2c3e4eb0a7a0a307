"""A load that failed after it began writing leaves the engine torn: its training calls refuse until a load succeeds.

[Note: a torn load]
A load writes the checkpoint's values into the engine as it reads them, so one that fails part way (a shard whose
CRC does not match, a disk gone, an lr scheduler that refuses its state), on any rank, leaves the engine holding
part of the checkpoint and part of what it held before: some ranks' shards loaded and others' not, module weights
without their optimizer state, counters from the checkpoint. Training on would be training a model no one saved.
So a load is split in two: every rank first makes the checks that write nothing (`_plan`: keys, shapes, the
engine state file) and the ranks agree on them (one round on the store), so a checkpoint refused anywhere is
refused before any rank writes ("nothing was loaded"); what fails after that marks the engine torn on every rank,
and its forward, backward, step, train_batch, eval_batch and saves then refuse in one line naming the failed
load, until a load_checkpoint that writes at least as much succeeds (a load_module_only one repairs a torn
load_module_only load, not a torn full one). DeepSpeed has no such guard. A pipeline
engine is torn on every stage when any stage's load failed and any stage wrote ([Note: pipeline checkpoints]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from zeroshard.checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class TornLoad:
    why: str  # the failed call and each rank's error
    scope: int  # what it would have written (`load_scope`)


class Tearable(Protocol):
    _torn_load: TornLoad | None


def load_scope(load_optimizer_states: bool, load_module_only: bool) -> int:
    """How much a load writes: 0 the module weights (masters refreshed from them), 1 also counters, scheduler, RNG
    and sampler, 2 also the optimizer state."""
    return 0 if load_module_only else (2 if load_optimizer_states else 1)


def mark_torn(engine: Tearable, why: str, scope: int = 2) -> None:
    """Record that a load failed after it began writing ([Note: a torn load])."""
    held = engine._torn_load
    engine._torn_load = TornLoad(why, max(scope, held.scope if held is not None else 0))


def refuse_torn(engine: Tearable, call: str) -> None:
    """A one-line refusal of `call` on a torn engine ([Note: a torn load])."""
    if engine._torn_load is not None:
        raise CheckpointError(
            f"engine.{call}(): {engine._torn_load.why}, so this engine holds part of that checkpoint and part of its "
            "earlier state; load a checkpoint again (a load_checkpoint that succeeds clears this) or build a new engine"
        )


def repaired(engine: Tearable, scope: int) -> None:
    """A load of `scope` succeeded: it rewrote what a torn load of at most that scope left mixed."""
    if engine._torn_load is not None and scope >= engine._torn_load.scope:
        engine._torn_load = None
