"""A load that failed after it began writing leaves the engine torn: its training calls refuse until a load succeeds.

[Note: a torn load]
A load writes the checkpoint's values into the engine as it reads them, so one that fails part way (a shard whose
CRC does not match, a disk gone, an lr scheduler that refuses its state), on any rank, leaves the engine holding
part of the checkpoint and part of what it held before: some ranks' shards loaded and others' not, module weights
without their optimizer state, counters from the checkpoint. Training on would be training a model no one saved. So
a load is split in two (load_plan.py). Every rank first makes the checks that write nothing (`plan_load`: the
metadata, keys, shapes, the tensor-parallel slicing, the engine state file and its CRC, the files it will open:
`check_files`) and the ranks agree on them (one round on the store; a pipeline's stages too, one all-reduce, unless
they load in turns), so a checkpoint refused anywhere is refused before any rank writes: "nothing was loaded". Then
`load_into` writes the tensors first and the counters last, and a reader records when its first byte went into an
engine tensor (`delivered`). A failure once any rank wrote (a tensor whose CRC fails as it is read, a disk gone)
marks the engine torn on every rank (a pipeline's every stage). Its forward, backward, step, train_batch, eval_batch,
every save (save_checkpoint, save_16bit_model, the consolidated state dicts the HF Trainer and accelerate save) and
DeepSpeed's `safe_get_*`/`safe_set_*` of its parameters then refuse in one line naming the failed load, until a load
succeeds on every rank that restores: every module weight, after a failed load_module_only one; also the counters
and the lr scheduler (if the engine has one, whatever the failed call's load_lr_scheduler_states said), after a
failed full one; also the optimizer state, unless the
failed one had load_optimizer_states=False (a load with load_module_strict=False that misses some weights, or from a
checkpoint without optimizer state, restores less and does not clear it). DeepSpeed has no such guard.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from zeroshard.checkpoint.errors import CheckpointError

# What a load restores, in order: every module weight (masters refreshed from them); also the counters, RNG, sampler
# and lr scheduler; also the optimizer state and loss scaler.
MODULE, TRAINING, OPTIMIZER = 0, 1, 2
_CURE = {
    MODULE: "a load_checkpoint that restores every module weight",
    TRAINING: "a load_checkpoint that restores every module weight, the counters and the lr scheduler",
    OPTIMIZER: "a load_checkpoint that restores every module weight, the counters, the lr scheduler and the optimizer "
    "state",
}


@dataclass(frozen=True)
class TornLoad:
    why: str  # the failed call and each rank's error
    scope: int  # what it would have written (`load_scope`): what a load must restore to repair it


class Tearable(Protocol):
    _torn_load: TornLoad | None


def load_scope(load_optimizer_states: bool, load_module_only: bool) -> int:
    """What a load with these arguments writes."""
    return MODULE if load_module_only else (OPTIMIZER if load_optimizer_states else TRAINING)


# the strategies of torn engines -> what their state getters and setters say (`refuse_torn_state`): DeepSpeed's
# `safe_get_*`/`safe_set_*` reach a strategy from a parameter, not the engine
_TORN_STATE: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_torn(engine: Tearable, why: str, scope: int = OPTIMIZER) -> None:
    """Record that a load failed after it began writing ([Note: a torn load])."""
    held = engine._torn_load
    engine._torn_load = TornLoad(why, max(scope, held.scope if held is not None else MODULE))
    _share(engine)


def _share(engine: Tearable) -> None:
    strategy = getattr(engine, "strategy", None)
    if strategy is None:
        return
    if engine._torn_load is None:
        _TORN_STATE.pop(strategy, None)
    else:
        _TORN_STATE[strategy] = _refusal(engine)


def refuse_torn_state(strategy: Any, call: str) -> None:
    """`call` (a `safe_get_*`/`safe_set_*` of a parameter `strategy` trains) refused on a torn engine: its values are
    part checkpoint, part earlier state, and at stage 3 a state the failed load had not written yet is missing on
    some ranks (a KeyError there while the others waited in the gather to the collective deadline)."""
    refusal = _TORN_STATE.get(strategy)
    if refusal is not None:
        raise CheckpointError(f"{call}(): {refusal}")


def cure(engine: Tearable) -> str:
    """What clears the engine's torn state, for the messages."""
    return _CURE[engine._torn_load.scope if engine._torn_load is not None else MODULE]


def refuse_torn(engine: Tearable, call: str) -> None:
    """A one-line refusal of `call` on a torn engine ([Note: a torn load])."""
    if engine._torn_load is not None:
        raise CheckpointError(f"engine.{call}(): {_refusal(engine)}")


def _refusal(engine: Tearable) -> str:
    assert engine._torn_load is not None
    return (
        f"{engine._torn_load.why}, so this engine holds part of that checkpoint and part of its earlier state; "
        f"{cure(engine)} clears this, or build a new engine"
    )


def repaired(engine: Tearable, restored: int) -> None:
    """A load succeeded that restored `restored` (-1: not every module weight): it clears a torn load of at most that
    scope."""
    if engine._torn_load is not None and restored >= engine._torn_load.scope:
        engine._torn_load = None
        _share(engine)
