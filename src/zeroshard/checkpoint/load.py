"""`load_checkpoint`: each rank reads the ranges it owns under its current layout, from any layout.

Order of restoration (DeepSpeed's semantics):
- module weights always (strict key check per `load_module_strict`);
- `load_module_only`: nothing else; master weights are refreshed from the loaded module weights;
- otherwise counters, RNG, sampler position, the lr scheduler (`load_lr_scheduler_states`), and with
  `load_optimizer_states` the fp32 master weights, optimizer state and loss scaler (else the master
  weights are refreshed from the module weights, as DeepSpeed's `_restore_from_bit16_weights`).
When the world size changed, the global batch is kept by adapting gradient accumulation (unless the
config pins `train_batch_size`), see `adapt_batch`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.checkpoint import custom_load as _custom_load
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import LATEST_FILE, METADATA_FILE
from zeroshard.checkpoint.load_plan import LoadPlan, Reads
from zeroshard.checkpoint.load_plan import load_into as _load_into
from zeroshard.checkpoint.load_plan import plan_load as _plan
from zeroshard.checkpoint.node_local import node_local, saved_by
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.save import engine_state
from zeroshard.checkpoint.sync import ENTRY_PHASE, RankSync, describe_errors, entry_timeout, write_timeout
from zeroshard.checkpoint.torn import cure, load_scope, mark_torn, repaired
from zeroshard.checkpoint.universal import LATEST_UNIVERSAL
from zeroshard.comm.topology import NodeLayout
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def resolve_tag_dir(load_dir: str, tag: str | None, latest_file: str = LATEST_FILE) -> str | None:
    """`<load_dir>/<tag>` (tag from `latest` when None); None when there is no `latest`."""
    if tag is None:
        latest = os.path.join(load_dir, latest_file)
        if not os.path.isfile(latest) and latest_file == LATEST_UNIVERSAL:
            raise CheckpointError(f"{latest}: missing (ds_to_universal writes it); pass tag= to name the checkpoint")
        if os.path.isdir(latest):
            raise CheckpointError(f"{latest}: a folder where the pointer file to the last tag belongs; pass tag=")
        if not os.path.isfile(latest):
            return None
        try:
            with open(latest, encoding="utf-8") as f:
                tag = f.read().strip()
        except UnicodeDecodeError:
            raise CheckpointError(
                f"{latest}: not a tag name (not text: damaged?); write a tag of {load_dir} into it or pass tag="
            ) from None
        if not tag:
            raise CheckpointError(
                f"{latest}: empty, it names no checkpoint; write a tag of {load_dir} into it or pass tag="
            )
        named = f" (named by {latest})"
    else:
        named = ""
    tag_dir = os.path.join(load_dir, str(tag))
    if os.path.isdir(tag_dir):
        return tag_dir
    # A crash between the two renames of a re-save leaves the complete old copy aside (see [Note: crash safety]).
    for old in sorted(glob.glob(os.path.join(glob.escape(load_dir), f".old.{glob.escape(str(tag))}.*"))):
        if os.path.isfile(os.path.join(old, METADATA_FILE)):
            log_rank(logger, 30, f"{tag_dir} is missing (a save of it was interrupted); using its old copy {old}")
            return old
    raise CheckpointError(f"{tag_dir}: checkpoint directory does not exist{named}")


# -- the collective call -------------------------------------------------------------------------------
def _turns(engine: CheckpointableEngine) -> tuple[int | None, int]:
    """`zero_optimization.pipeline_loading_checkpoint` (DeepSpeed's serial load; every stage here): the ranks of a
    node read their files one after another in local-rank order, so a node holds one rank's transient load buffers at
    a time instead of all of them. Returns the rank this one waits for (None: the first on its node, or the option off)
    and how many loads its node runs one after another (1 with the option off): the deadlines of the waits that
    span them grow with it, so a healthy node of many ranks is not taken for a stuck one."""
    if not engine.config.zero_optimization.pipeline_loading_checkpoint:
        return None, 1
    rank = engine.topology.rank
    nodes = NodeLayout.from_env(engine.topology.world_size)
    return (rank - 1 if nodes.local_of(rank) > 0 else None), nodes.ranks_per_node


def _said(error: BaseException | None) -> str | None:
    """An error as the other ranks are told it (never empty: a bare `AssertionError()` is named by its type)."""
    return None if error is None else str(error) or repr(error)


@dataclasses.dataclass
class _Checked:
    """A load whose checks every rank passed: nothing written yet."""

    tag_dir: str
    plan: LoadPlan
    sync: RankSync
    after: int | None  # the rank whose turn comes before this one's (pipeline_loading_checkpoint)
    in_line: int  # loads in turn on this node


def _check(
    engine: CheckpointableEngine,
    load_dir: str | os.PathLike[str],
    tag: Any,
    load_module_strict: bool,
    reads: Reads,
    custom: bool = False,
) -> _Checked | None:
    """The entry phase and the checks that write nothing, agreed by every rank ([Note: a torn load]); None when
    there is no `latest` to load. `custom`: a custom load function places the module weights."""
    rank, world_size = engine.topology.rank, engine.topology.world_size
    root = os.path.abspath(os.fspath(load_dir))
    sync = RankSync("load_checkpoint", rank, world_size, prefix=engine.topology.store_prefix)
    resolved: dict[str, Any] = {"dir": None, "error": None}
    universal = bool(engine.config.checkpoint.load_universal)  # [Note: universal checkpoints]
    try:
        latest = LATEST_UNIVERSAL if universal else LATEST_FILE
        resolved["dir"] = resolve_tag_dir(root, None if tag is None else str(tag), latest)
        if node_local(engine) is not None:  # each node's folder: of one save ([Note: node-local checkpoints])
            resolved["save"] = saved_by(resolved["dir"])
    except Exception as e:  # noqa: BLE001 - reported to every rank below, not raised on this one alone
        resolved["error"] = str(e)
    hello = sync.all_gather(ENTRY_PHASE, resolved, entry_timeout())
    errors = sorted({h["error"] for h in hello if h["error"]})
    if errors:
        raise CheckpointError("; ".join(errors))
    dirs = [h["dir"] for h in hello]  # node-local: each node its own folder, the same tag ([Note: node-local ..])
    same = {os.path.basename(d) if d and node_local(engine) is not None else d for d in dirs}
    if len(same) > 1:
        raise CheckpointError(f"load_checkpoint: ranks resolved different checkpoints {dirs}")
    if len({h.get("save") for h in hello}) > 1:
        saves = sorted({f"{h['save']} ({h['dir']})" for h in hello})
        raise CheckpointError(
            f"load_checkpoint: the nodes' folders hold different saves of one tag: {saves} (a save whose commit "
            "failed on some nodes); load a tag every node committed"
        )
    tag_dir = resolved["dir"]
    if tag_dir is None:
        log_rank(logger, 30, f"no {LATEST_FILE} file in {root}: nothing loaded (pass tag= to load a given checkpoint)")
        return None
    after, in_line = _turns(engine)
    plan, local_error = None, None
    try:  # with pipeline_loading_checkpoint in the node's turns, as the reads
        with sync.in_turn(after, write_timeout() * max(1, in_line - 1), "plan_turn"):
            plan = _plan(engine, tag_dir, universal, load_module_strict, in_line == 1, reads, custom)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = e
    refused = describe_errors(sync.all_gather("checked", {"error": _said(local_error)}, write_timeout() * in_line))
    if refused:
        if plan is not None:
            plan.close()
        sync.leave(write_timeout())
        raise CheckpointError(f"load_checkpoint({tag_dir!r}) refused, nothing was loaded: {refused}") from local_error
    assert plan is not None
    return _Checked(tag_dir, plan, sync, after, in_line)


def load_checkpoint(
    engine: CheckpointableEngine,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    across: Callable[[bool], bool] | None = None,
    custom_load_fn: Callable[..., Any] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """See `CheckpointMixin.load_checkpoint`. `across`: whether some other group refused its checks, given whether
    this one did, called once on every rank whatever happened (a pipeline's stages, each loading its own folder at
    the same time: [Note: a torn load])."""
    checked, refusal = None, None
    try:
        optimizer = load_optimizer_states and not load_module_only and engine.basic_optimizer is not None
        reads = Reads(optimizer, not load_module_only)
        checked = _check(engine, load_dir, tag, load_module_strict, reads, custom_load_fn is not None)
    except BaseException as e:  # noqa: BLE001 - raised below, once the other groups have been told
        refusal = e
    if across is not None and across(refusal is not None) and refusal is None:
        if checked is not None:
            checked.plan.close()
            checked.sync.leave(write_timeout())
        where = checked.tag_dir if checked is not None else os.fspath(load_dir)
        raise CheckpointError(
            f"load_checkpoint({where!r}) refused, nothing was loaded: another pipeline stage refused its part (its "
            "ranks raise the cause)"
        )
    if refusal is not None:
        raise refusal
    if checked is None:
        return None, None
    tag_dir, plan, sync, after, in_line = checked.tag_dir, checked.plan, checked.sync, checked.after, checked.in_line
    if custom_load_fn is not None:  # [Note: custom_load_fn]: collective, before the reads taken in turns
        try:
            _custom_load.refuse(engine, plan)
        except BaseException:
            plan.close()
            sync.leave(write_timeout())
            raise
        try:
            if engine.strategy is not None:
                engine.strategy.loading(done=False)
            _custom_load.apply(engine, plan, custom_load_fn)
        except Exception as err:  # raised on every rank alike (the module load agrees on its outcome)
            plan.close()
            sync.leave(write_timeout())
            why = f"load_checkpoint({tag_dir!r}): custom_load_fn failed ({_said(err)})"
            mark_torn(engine, why, load_scope(load_optimizer_states, load_module_only))
            raise CheckpointError(
                f"{why}; it may have written part of the module, so the engine refuses to train or save until "
                f"{cure(engine)} succeeds"
            ) from err
        if reads.optimizer and plan.missing:
            log_rank(
                logger,
                30,
                f"the checkpoint holds no optimizer state under the names of {plan.missing[:10]} (of "
                f"{len(plan.missing)}): theirs starts fresh from the weights custom_load_fn wrote",
            )
        plan.module_by_name, plan.missing, plan.touched = False, [], True
    local_error: Exception | None = None
    client_state: dict[str, Any] | None = None
    publish, restored = False, -1
    try:
        if engine.strategy is not None:  # every rank passed the checks: this load writes
            engine.strategy.loading(done=False)
        with sync.in_turn(after, write_timeout() * max(1, in_line - 1)):
            with torch.profiler.record_function("zeroshard.load_checkpoint"):
                client_state, publish, restored = _load_into(
                    engine, plan, load_optimizer_states, load_lr_scheduler_states, load_module_only
                )
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = e
    plan.close()
    status = {"error": _said(local_error), "wrote": plan.wrote, "restored": restored}
    statuses = sync.all_gather("loaded", status, write_timeout() * in_line)
    sync.leave(write_timeout() * in_line)
    if any(s["error"] for s in statuses):
        described = describe_errors(statuses)
        if any(s["wrote"] for s in statuses):
            why = f"load_checkpoint({tag_dir!r}) failed part way ({described})"
            mark_torn(engine, why, load_scope(load_optimizer_states, load_module_only))
            raise CheckpointError(
                f"{why}; the engine holds part of the checkpoint and refuses to train or save until {cure(engine)} "
                "succeeds"
            ) from local_error
        raise CheckpointError("load_checkpoint failed, nothing was loaded: " + described) from local_error
    repaired(engine, min(s["restored"] for s in statuses))  # what every rank restored: the engine's state is theirs
    # Collectives only once every rank is known to have loaded (a failed rank would never join them).
    if engine.strategy is not None:
        state = engine_state(engine)
        # stage 3 loads shards only: copies gathered from them (its persistent unit) must be gathered again
        if state is not None and (publish or state.regather_after_load):
            state.publish_params()
        engine.strategy.loading(done=True)
        engine.strategy.zero_grad()  # (a backward that raised is dropped too: [Note: a backward that raised])
        engine.accumulation.pending = engine.accumulation.unfinished = False
        engine.accumulation.window_backwards = 0
    log_rank(logger, 20, f"loaded checkpoint {tag_dir}")
    return tag_dir, client_state
