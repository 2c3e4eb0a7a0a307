"""`offload_optimizer.super_offload`: the host steps offloaded sub-groups while backward still runs.

[Note: speculative host steps]
With the optimizer offloaded, the host's Adam over every master runs after backward while the GPU waits (issue 13's
row (b): 0.85 s of Adam after a 1.13 s GPU step at 3.91B parameters). Stage 3 reduces gradients unit by unit, last
layers first, and copies each final shard to the host on the accumulation boundary. As soon as every unit of an
offloaded sub-group has arrived, a worker thread steps that sub-group and publishes its masters to the compute
shards (on a stream of its own on CUDA) while the main thread goes on with backward; torch's CPU kernels release
the GIL, so both run at once. This is DeepSpeed's SuperOffload ("speculation-then-validation", DeepSpeed 0.18,
`super_offload: true`), where the step's outcome does not depend on gradients that have not arrived yet:
- Without gradient clipping the factor each gradient is multiplied by (the mean over ranks, the fp16 loss scale) is
  known before the norm is. With clipping every sub-group waits for the global norm, so the step runs after
  backward, as in DeepSpeed (a warning at start says so).
- A step can still be skipped: an fp16 overflow, or a non-finite norm ([Note: skipped steps]). A sub-group whose
  own gradients are not finite is not stepped and ends speculation for the window. If the step is skipped anyway
  (another sub-group, another rank), the sub-groups stepped already are stepped back ([Note: undoing an Adam step]
  in optim/rollback.py: arithmetically, as DeepSpeed does, so not to the bit) and published again;
  `engine.zero_grad()` without a step does the same, and so does a `load_checkpoint` before it writes (a
  module-only load keeps the optimizer state, which would otherwise hold a step never taken). Hence Adam/AdamW only.
When the step is taken, the sub-groups stepped during backward are not stepped again, and the result is
bit-identical to stepping after backward (the same gradients, factors and kernels per element; the order of
sub-groups does not matter). What a user can see: when `engine.backward()` returns, every offloaded sub-group's
masters, optimizer state and parameters hold the step's update (`engine.step()` commits it, with the learning rate
and weight decay they were stepped with); between the boundary's backward and the step, a second backward (its
gradients would miss that update) and the setters of masters, gradients and optimizer states (DeepSpeed's
`safe_set_*`, `engine.optimizer.load_state_dict`: the step they would change has run) are refused, on every rank
alike, whether or not this rank stepped anything (its own gradients may have held inf/nan). Only sub-groups
complete while autograd still runs overlap it: more sub-groups mean more overlap (`sub_group_size`); the root
unit's (embeddings, the head) and the sub-groups whose last reductions are in flight when autograd returns (at most
MAX_INFLIGHT_REDUCES units) are stepped as backward ends, and the persistent unit, reduced only then, gets a
sub-group of its own rather than delay the last layers'.
A failure on the worker leaves the step's state unknown: it is re-raised when backward ends, on every rank (one small
all-reduce at the boundary: a rank whose worker did not fail names the ranks whose did), and every later backward,
step and zero_grad refuses with the same message (resume from a checkpoint).

`cpuadam_cores_perc` (CUDA only): the worker thread, and the intra-op threads it starts, keep to that fraction of
this rank's cores (the last ones; at least one, and one fewer than all; a rank whose mask is the whole machine
takes its 1/LOCAL_WORLD_SIZE slice first). The other threads are left as they are (DeepSpeed restricts its main
process to the rest; here autograd's device thread launches backward's kernels, not the main thread, and
DataLoader workers forked later would inherit a narrowed mask). Without a GPU the main thread computes the model,
so the worker shares every core.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.optim.rollback import undo_adam_step, undoable_reason
from zeroshard.utils.logging import log_rank
from zeroshard.zero.stage3.step import SubGroupStepper
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.stepmath import tensor_norms

logger = logging.getLogger(__name__)

WORKER_JOIN_S = 60.0


@dataclass(frozen=True)
class SpeculationPolicy:
    """From the config: the worker's share of the cores, and whether a step can still be skipped."""

    cores_fraction: float  # offload_optimizer.cpuadam_cores_perc
    may_skip: bool  # fp16 overflow or a non-finite norm can skip the step ([Note: skipped steps])


def worker_cores(cores: list[int], fraction: float, local_rank: int, local_ranks: int, machine: int) -> list[int]:
    """The cores the worker thread keeps to (none: leave it as it is): the last `fraction` of this rank's, at least
    one and one fewer than all. The node's ranks' masks can only be disjoint if together they fit on the machine;
    a mask too large for that is shared (no binding, a cgroup, a cpuset), so each rank takes its own slice of it
    first (a launcher that binds ranks to cores has done that already)."""
    if local_ranks > 1 and len(cores) * local_ranks > machine and len(cores) >= local_ranks:
        per = len(cores) // local_ranks
        cores = cores[local_rank * per : (local_rank + 1) * per]
    if len(cores) < 2:
        return []
    take = min(max(round(fraction * len(cores)), 1), len(cores) - 1)
    return cores[len(cores) - take :]


def keep_to_share(fraction: float, threads: int) -> list[int]:
    """The calling thread (and the intra-op threads it starts) keeps to its `worker_cores`, with at most `threads`
    intra-op threads; returns them (none: left as it was). Best effort: a refusal, e.g. by a cpuset, leaves the
    thread where it was, with a warning."""
    cores = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = worker_cores(cores, fraction, *local, os.cpu_count() or len(cores))
    if not mine:
        return []
    try:
        os.sched_setaffinity(0, mine)  # this thread only
    except OSError as error:
        log_rank(logger, logging.WARNING, f"super_offload: cpuadam_cores_perc not applied ({error})", None)
        return []
    torch.set_num_threads(min(len(mine), threads))  # this thread's intra-op pool
    return mine


@dataclass(frozen=True)
class _Job:
    k: int
    scale: float
    events: tuple[torch.cuda.Event, ...]
    during_backward: bool


class SpeculativeSteps:
    """The worker thread and what it stepped in the current window ([Note: speculative host steps])."""

    def __init__(
        self,
        stepper: SubGroupStepper,
        policy: SpeculationPolicy,
        scale_of: Callable[[], float],
        device: torch.device,
    ):
        self.stepper = stepper
        self.scale_of = scale_of  # the gradients' scale without clipping: the mean over ranks, the fp16 loss scale
        self.sub_groups = sub_groups = stepper.sub_groups
        self.gradients = stepper.gradients
        self.policy = policy
        self.device = device
        self._group_of = {
            u.index: k for k, g in enumerate(sub_groups) if g.tier.offloaded for u in g.units if u.trainable
        }
        self._expected: dict[int, int] = {}
        for k in self._group_of.values():
            self._expected[k] = self._expected.get(k, 0) + 1
        self._waiting = dict(self._expected)
        self.stepped: list[int] = []  # sub-groups stepped in this window, in order
        self.scale: float | None = None  # the scale they were stepped with
        self._halted = False  # a sub-group with non-finite gradients: the rest wait for the step
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None  # the worker's, until `settle` hands it over
        self._broken: str | None = None  # a step failed on the worker: this window's state is not known to be whole
        self._threads = torch.get_num_threads()  # the main thread's intra-op count: the process's default
        self._default_restored = False
        self._stream: torch.cuda.Stream | None = None  # the worker's (CUDA)
        self._delivered = False  # this window's boundary gradients have arrived (the same on every rank)
        self._backward_done = False  # the boundary's backward has returned (`settle`): no backward until the step
        self.steps_taken = 0  # sub-group steps taken by the worker, over the run
        self.taken_during_backward = 0  # of which submitted while autograd still ran (not as backward ended)
        self.steps_undone = 0

    # -- backward (main thread) ----------------------------------------------------------------------
    def delivered(self, unit: ShardedUnit, during_backward: bool) -> None:
        """`unit`'s gradient shard is final for the boundary and in its host copy (queued, on CUDA);
        `during_backward`: autograd is still running (not the reductions made as backward ends)."""
        k = self._group_of.get(unit.index)
        if k is None:
            return
        self._delivered = True
        self._waiting[k] -= 1
        if self._waiting[k] == 0:
            from zeroshard.checkpoint.decoupled import wait_for_writes  # zeroshard.zero is imported before checkpoint

            wait_for_writes()  # a decoupled save's thread has written the state this step changes (a direct backward)
            self._submit(_Job(k, self.scale_of(), self._events(), during_backward))

    def _events(self) -> tuple[torch.cuda.Event, ...]:
        """What the worker waits for before it reads the copies and the norms: the side stream's copies and the
        compute stream's work queued so far."""
        if self.device.type != "cuda":
            return ()
        events = [torch.cuda.current_stream(self.device).record_event()]
        if self.gradients.copy_stream is not None:
            events.append(self.gradients.copy_stream.record_event())
        return tuple(events)

    def _submit(self, job: _Job) -> None:
        if self._thread is None:  # holds no reference to this object: an engine dropped without destroy() is freed
            args = (weakref.ref(self), self._jobs)
            self._thread = threading.Thread(target=_work, args=args, name="zeroshard-super-offload", daemon=True)
            self._thread.start()
            weakref.finalize(self, _stop, self._jobs)
        self._jobs.put(job)

    def check_no_backward(self) -> None:
        """A backward starts, or a gradient arrives: refused once the boundary's backward has returned, until the
        step (its gradients would miss the update already taken)."""
        self._check_whole()
        if self._backward_done:
            raise ZeroshardError(
                "a second backward before engine.step(): with zero_optimization.offload_optimizer.super_offload the "
                "first one's optimizer steps already ran during its backward; call engine.step() between backward "
                "passes (gradient_accumulation_steps accumulates) or set super_offload false"
            )

    def check_unchanged(self, call: str) -> None:
        """`call` changes a value the step reads or writes (a master, a gradient, an optimizer state): refused
        between the boundary's backward and the step, on every rank alike ([Note: speculative host steps])."""
        self._check_whole()
        if self._backward_done:
            raise ZeroshardError(
                f"{call} between backward and engine.step(): with zero_optimization.offload_optimizer.super_offload "
                "the optimizer steps of this window ran during backward; set values after engine.step() or set "
                "super_offload false"
            )

    def settle(self, comm: Collectives) -> None:
        """Wait until the worker has taken every step queued (end of backward, before the step); re-raises its error,
        and at the boundary every rank learns whether any rank's worker failed (one small all-reduce over `comm`)
        and raises too: else the others went on into the step's collectives and waited there to the deadline."""
        # whether the boundary's gradients arrived, not whether this rank stepped: a rank whose gradients hold
        # inf/nan steps nothing, and the refusals that follow must be the same on every rank (else one rank raises
        # while the others wait in the step's collectives)
        self._backward_done = self._delivered
        failure = None
        if self._thread is not None:
            self._jobs.join()
            failure, self._failure = self._failure, None
        failed = [comm.rank] if failure is not None else []
        if self._delivered and comm.world_size > 1:
            flags = torch.zeros(comm.world_size, device=self.device)
            flags[comm.rank] = float(failure is not None)
            comm.all_reduce(flags, label="super_offload outcome")
            failed = [r for r, flag in enumerate(flags.tolist()) if flag]
        if failed:
            what = (
                f"failed ({failure!r})" if failure is not None else f"failed on rank(s) {failed} (their error says why)"
            )
            self._broken = (
                f"super_offload's optimizer step during backward {what}, so this step's master weights and optimizer "
                "state may be partly updated; load the last checkpoint (engine.load_checkpoint) to go on"
            )
            raise ZeroshardError(self._broken) from failure
        if self.device.type == "cuda" and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            if not self._default_restored:  # the worker's count stays its own; threads started later get the default
                torch.set_num_threads(self._threads)
                self._default_restored = True

    def _check_whole(self) -> None:
        if self._broken is not None:
            raise ZeroshardError(self._broken)

    # -- the worker (its thread: `_work`) -------------------------------------------------------------------
    def _bind(self) -> None:
        """On the worker thread, once (CUDA): its device, its stream and its share of the cores."""
        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(self.device)
        keep_to_share(self.policy.cores_fraction, self._threads)

    def _run(self, job: _Job) -> None:
        if self.device.type == "cuda" and self._stream is None:
            self._bind()
        if self._halted or self._failure is not None:
            return
        for event in job.events:
            event.synchronize()
        units = self.sub_groups[job.k].units
        with contextlib.ExitStack() as stack:
            if self._stream is not None:  # the worker's own stream: nothing here waits on the compute stream
                stack.enter_context(torch.cuda.stream(self._stream))
            if self.policy.may_skip and not self._finite(units):
                self._halted = True
                return
            with torch.profiler.record_function("zeroshard.speculative_step"):
                self.stepper.step_sub_group(job.k, units, job.scale, private=True)
        self.scale = job.scale
        self.stepped.append(job.k)
        self.steps_taken += 1
        self.taken_during_backward += job.during_backward

    def _finite(self, units: list[ShardedUnit]) -> bool:
        """Whether this sub-group's gradient norms are finite (then it holds no inf/nan): from the records of shards
        that left memory, else from the shards."""
        norms: list[torch.Tensor] = []
        for unit in units:
            record = self.gradients.recorded(unit.grad_key)
            norms += record.norms if record is not None else tensor_norms([unit.grad_shard])
        return not norms or bool(torch.isfinite(torch.stack(norms)).all())

    # -- the step (main thread, after `settle`) -------------------------------------------------------
    def scaled(self, unit: ShardedUnit) -> bool:
        """Whether `unit`'s host copy was multiplied by the step's scale already (its sub-group was stepped)."""
        k = self._group_of.get(unit.index)
        return k is not None and k in self.stepped

    def commit(self, scale: float) -> frozenset[int]:
        """The step is taken with `scale`: the sub-groups stepped during backward count as stepped."""
        self._check_whole()
        done = frozenset(self.stepped)
        if done and scale != self.scale:
            raise ZeroshardError(f"super_offload stepped with gradient scale {self.scale} but the step's is {scale}")
        self._reset()
        return done

    def undo(self, why: str) -> None:
        """The window's gradients are dropped (`why`): its speculative steps are stepped back and republished."""
        self._check_whole()
        if self.stepped:
            assert self.stepper.optimizer is not None and self.scale is not None
            for k in self.stepped:  # the worker's copies out of these masters are done before they change
                for unit in self.sub_groups[k].units:
                    unit.wait_published()
            for k in reversed(self.stepped):
                units = self.sub_groups[k].units
                stepped = self.stepper.gradients_of(k, units, self.scale, private=True, stepped=True)
                undo_adam_step(self.stepper.optimizer, stepped)
                for unit in units:
                    unit.publish()
            for k in self.stepped:
                for unit in self.sub_groups[k].units:
                    unit.wait_published()
            self.steps_undone += len(self.stepped)
            log_rank(
                logger,
                logging.INFO,
                f"super_offload: {why}; {len(self.stepped)} sub-group step(s) taken during backward were undone "
                "(to within float rounding)",
            )
        self._reset()

    def before_load(self) -> None:
        """A load is about to write: the window's steps taken during backward are stepped back first, as zero_grad
        would (the load drops the window's gradients), so what the load does not replace (a module-only load keeps
        the optimizer state) holds no step that was never taken. After a worker failure nothing is known to be
        whole: `forget` follows the load."""
        if self._broken is None and self.stepped:
            self.undo("load_checkpoint drops the window's gradients")

    def forget(self) -> None:
        """A checkpoint was loaded: this window's speculative steps, and a failure's doubt, went with the old state."""
        self._broken = None
        self._reset()

    def _reset(self) -> None:
        self.stepped = []
        self.scale = None
        self._halted = False
        self._delivered = False
        self._backward_done = False
        self._waiting = dict(self._expected)

    def close(self) -> None:
        if self._thread is not None:
            _stop(self._jobs)
            self._thread.join(WORKER_JOIN_S)
            self._thread = None


def _work(owner: weakref.ref[SpeculativeSteps], jobs: queue.Queue[_Job | None]) -> None:
    """The worker thread: takes each job to its owner while the owner lives; a failure is kept for `settle`."""
    while True:
        job = jobs.get()
        try:
            steps = owner() if job is not None else None
            if steps is None:
                return
            try:
                steps._run(job)  # type: ignore[arg-type]  # not None here
            except BaseException as failure:  # handed to the main thread by `settle`
                steps._failure = failure
            del steps  # no reference while waiting for the next job
        finally:
            jobs.task_done()


def _stop(jobs: queue.Queue[_Job | None]) -> None:
    """The worker ends after the jobs queued."""
    jobs.put(None)


def speculation_for(
    stepper: SubGroupStepper, policy: SpeculationPolicy | None, scale_of: Callable[[], float], device: torch.device
) -> SpeculativeSteps | None:
    """The worker when `super_offload` has offloaded sub-groups to speculate on, else None."""
    if policy is None or not any(g.tier.offloaded for g in stepper.sub_groups):
        return None
    return SpeculativeSteps(stepper, policy, scale_of, device)


def check_undoable(optimizer: torch.optim.Optimizer, speculation: SpeculativeSteps | None) -> None:
    """[Note: speculative host steps] undo a skipped step's updates: refuse an optimizer whose step cannot be undone."""
    reason = undoable_reason(optimizer) if speculation is not None else None
    if reason is not None:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.super_offload: true needs an optimizer whose step zeroshard can "
            f"undo, but {reason}: use Adam/AdamW or set super_offload false"
        )
