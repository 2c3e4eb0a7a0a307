"""The contract between the engine and a ZeRO strategy, and the accumulation state both read.

[Note: strategy contract]
The engine owns the training loop's counters (`AccumulationState`) and hands them to the strategy at
construction; the strategy reads them (is this micro-step communicated? is it the last before the step?) and
never calls back into the engine. Everything the engine, the checkpoint code and the public API need from a
strategy is a method of `Strategy`: there is no `isinstance` or `getattr` on strategies anywhere. Three
implement it: `FlatStrategy` (stages 0-2, zero/flat/), `Stage3Strategy` (zero/stage3/) and `Fsdp2Strategy`
(the fsdp2 backend over PyTorch's fully_shard, fsdp2/). All share the step skeleton below: finish the
reductions, one norm (and inf/nan) decision for all ranks, the optimizer over chunks of the shards, publish the
parameters.

[Note: caller-owned windows]
With `managed_gradient_accumulation: false` (DeepSpeed 0.19's key) the script ends a window where it calls
`engine.step()`, after as many `engine.backward` calls as it likes (tokens per step, a variable number of rollouts).
No backward is a boundary: stages 0-1 accumulate locally, stages 2-3 reduce every micro-step as always, and their
gradient tiers take the shards at the step rather than during a last backward. `step()` is the boundary while it
runs: stages 0-1 reduce the window's accumulation then (`Strategy.end_window`), and every call steps the optimizer.
backward still divides the loss by `gradient_accumulation_steps` (unless `scale_wrt_gas=False`), so a window of k
micro-batches steps on k/gas times their mean gradient, as in DeepSpeed; `global_samples` grows by the micro-batches
the window ran. Refused as DeepSpeed refuses them: `set_gradient_accumulation_boundary` and a PipelineModule; and
super_offload, whose host steps run during the boundary's backward.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zeroshard.comm.agreement import CallAgreement
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ZeroshardError
from zeroshard.memory import StrategyMemory
from zeroshard.offload.gradients import GradientTier, GradShard
from zeroshard.offload.tier import Tier
from zeroshard.zero.stepmath import StepPolicy, scale_from_norms, shard_gradient

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import ShardedState


@dataclass
class AccumulationState:
    """Where the training loop is within a gradient-accumulation window (owned by the engine)."""

    gradient_accumulation_steps: int
    communicate_every_micro_step: bool  # stages 2-3 reduce (scatter) every micro-step; stages 0-1 on the boundary
    micro_steps: int = 0
    no_sync_depth: int = 0  # inside engine.no_sync()
    loss_scale: float = 1.0  # the fp16 loss scale of the last engine.backward: the accumulated gradients carry it
    # engine.set_gradient_accumulation_boundary (DeepSpeed's): the caller says where windows end; None: count
    boundary: bool | None = None
    pending: bool = False  # gradients accumulated since the last optimizer step (or zero_grad)
    # `managed_gradient_accumulation: false` ([Note: caller-owned windows]): every engine.step() ends a window
    managed: bool = True
    stepping: bool = False  # inside engine.step() (the boundary when windows are the caller's)
    window_backwards: int = 0  # engine.backward calls since the last step, for global_samples then
    coalescing: bool = False  # inside engine.coalesce_grad_reduction(): [Note: coalesced gradient reduction]
    unfinished: bool = False  # a backward began and raised before it ended: [Note: a backward that raised]

    def is_boundary(self) -> bool:
        """The current micro-step is the last before the optimizer step."""
        if not self.managed:
            return self.stepping
        if self.boundary is not None:
            return self.boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def communicates(self) -> bool:
        """The current micro-step's gradients are reduced across ranks during its backward."""
        return self.communicate_every_micro_step or (self.is_boundary() and self.no_sync_depth == 0)

    @contextlib.contextmanager
    def inside_step(self) -> Iterator[None]:
        """engine.step() runs: the boundary of a window the caller owns."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def after_step(self, train_batch_size: int) -> int:
        """After the optimizer step: the samples the window trained on (as many micro-batches as the caller ran when
        the windows are its own), and nothing is pending."""
        samples = train_batch_size
        if not self.managed:
            samples = train_batch_size // self.gradient_accumulation_steps * self.window_backwards
        self.pending, self.window_backwards = False, 0
        return samples


@dataclass(frozen=True)
class StepOutcome:
    skipped: bool
    grad_norm: float | None


@dataclass(frozen=True)
class ParamGroupSpec:
    """A parameter group as the user gave it: hyperparameters and its (named) parameters."""

    options: dict[str, Any]
    params: list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class StrategyPolicy:
    """What every stage needs to know, decided once from the config (each stage's policy adds its own)."""

    compute_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    overlap_comm: bool
    step: StepPolicy
    master_tier: Tier  # where master weights and optimizer state live (offload_optimizer)
    master_dtype: torch.dtype = field(default=torch.float32, kw_only=True)  # [Note: bf16 master weights]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The elementwise state tensors (not scalars such as Adam's step)."""
    if optimizer is None:
        return []
    return [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


HostView = Callable[[torch.Tensor], "torch.Tensor | None"]  # a moved tensor's view of its host copy (offload_states)


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def held(tensor: torch.Tensor | None) -> int:
    """The bytes `tensor` holds now: 0 while its storage is empty (moved away by `engine.offload_states()`, a
    released stage-3 unit)."""
    return 0 if tensor is None else min(nbytes(tensor), tensor.untyped_storage().nbytes())


class Strategy(ABC):
    """One model's ZeRO state on one rank. See [Note: strategy contract]."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: StrategyPolicy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
    ):
        self.module = module
        self.group_options = [dict(g.options) for g in groups]
        self.step_policy = policy.step
        self.comm = comm
        self.device = device
        self.accumulation = accumulation  # the engine's: [Note: strategy contract]
        self.optimizer: torch.optim.Optimizer | None = None
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # where reduced gradients wait for the step, decided by the master's tier
        self.gradients_tier: GradientTier = policy.master_tier.gradients(copy_stream, policy.step.check_overflow)
        # whether the boundary's backward already changes masters and optimizer state (stage 3's super_offload): a
        # decoupled save commits before it then ([Note: decoupled checkpoint writes])
        self.steps_in_backward = False
        # engine.offload_states(): the kinds of state whose storages are empty until reload_states() ([Note:
        # offloaded states] in offload/states.py)
        self.offloaded: frozenset[str] = frozenset()
        # [Note: gathering calls agree first]
        self.agreement = CallAgreement(comm, self._agreement_timeout_s(policy, device), numbered=True)

    # -- construction ----------------------------------------------------------------------------------
    def _agreement_timeout_s(self, policy: StrategyPolicy, device: torch.device) -> float | None:
        """How long a gathering call waits for the other ranks' posts: the store's timeout (the group's deadline)."""
        return None

    def _land_gradients(self) -> None:
        """The host copies of gradients made during backward have arrived (before the step reads them)."""
        self.gradients_tier.landed()

    @abstractmethod
    def master_param_groups(self) -> list[dict[str, Any]]:
        """torch-style parameter groups over the fp32 master shards, the user's options kept."""

    @abstractmethod
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Use `optimizer` (built over `master_param_groups()`) for the step."""

    # -- backward --------------------------------------------------------------------------------------
    @abstractmethod
    def begin_backward(self) -> None:
        """A micro-step's backward starts (`engine.backward`; a plain `loss.backward()` is detected too)."""

    @abstractmethod
    def finish_backward(self) -> None:
        """Launch what backward did not, wait for every reduction, and end the micro-step's backward."""

    # -- the step ------------------------------------------------------------------------------------------
    def step(self, loss_scale: float = 1.0) -> StepOutcome:
        """Finish reductions, decide overflow and the global norm on every rank, step every chunk, publish."""
        assert self.optimizer is not None, "attach() an optimizer first"
        with torch.profiler.record_function("zeroshard.reduce_wait"):
            self.finish_backward()
        self._before_step()
        with_norms = self.step_policy.compute_norm
        norms, overflow = self.gradients_tier.norms(self._grad_slots(), self._make_grads_resident, with_norms)
        overflow = overflow or (self.step_policy.check_overflow and self._extra_overflow())
        norms += self._extra_norms() if with_norms else []
        decided = scale_from_norms(norms, overflow, self.comm, self._sharded, loss_scale, self.step_policy, self.device)
        if decided.overflow:
            self._land_gradients()  # no copy into host memory outlives the step, skipped or not
            self.zero_grad()  # the norm of inf/nan gradients reads inf where one is computed, as DeepSpeed's ZeRO
            return StepOutcome(skipped=True, grad_norm=float("inf") if with_norms else None)
        self._land_gradients()
        with torch.profiler.record_function("zeroshard.optimizer_step"):
            self._step_chunks(decided.scale)
        with torch.profiler.record_function("zeroshard.all_gather_params"):
            self._publish()
        self.zero_grad()
        return StepOutcome(skipped=False, grad_norm=decided.grad_norm)

    @property
    @abstractmethod
    def _sharded(self) -> bool:
        """Whether gradient shards differ across ranks (the norm needs an all-reduce)."""

    def _before_step(self) -> None:
        """Checks that must pass before any rank steps (none by default)."""
        return None

    def _extra_norms(self) -> list[torch.Tensor]:
        """Norms of gradients outside the shards that count in the global norm, in the same terms (summed over
        ranks, prescaled); none by default."""
        return []

    def _extra_overflow(self) -> bool:
        """Whether gradients the step applies outside `_grad_slots` hold inf/nan (asked when overflow is checked:
        the norm alone misses them without compute_grad_norm); none by default."""
        return False

    @abstractmethod
    def _grad_slots(self) -> list[GradShard]:
        """Every gradient shard, in the order the norm sums them."""

    def _make_grads_resident(self) -> None:
        """Gradient shards that left memory are about to be read back (nothing to do by default)."""
        return None

    @abstractmethod
    def _step_chunks(self, scale: float) -> None:
        """The optimizer over the shards, chunk by chunk (groups, sub-groups), gradients times `scale`."""

    @abstractmethod
    def _publish(self) -> None:
        """Every rank's updated shards become the parameters the next forward uses."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step."""

    def loading(self, done: bool) -> None:
        """`load_checkpoint` is about to write (`done` false) or has replaced the state: nothing from before it is
        pending (nothing to undo or forget by default)."""
        return None

    def end_window(self) -> None:
        """`engine.step()` ends a window the caller owns ([Note: caller-owned windows]): reduce what the window's
        backwards left unreduced. Nothing by default: stages 2-3 reduce every micro-step's gradients in its backward."""
        return None

    # -- one parameter's full values: DeepSpeed's safe_get_full_* (collective: every rank, same parameter) ---------
    @abstractmethod
    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s fp32 master value, whole, on the compute device (None for a frozen parameter, as DeepSpeed's)."""

    @abstractmethod
    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s gradient averaged over ranks (unscaled, not yet clipped), whole, in fp32; valid after the
        accumulation boundary's backward and before `step()`. None when there is none to read."""

    @abstractmethod
    def full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """`param`'s slice of the optimizer state `key` (e.g. "exp_avg"), whole; None before the optimizer made it."""

    @abstractmethod
    def set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """`param` := `value` (its whole value, the same on every rank): the fp32 master and the parameter the
        next forward uses (collective at stage 3)."""

    @abstractmethod
    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        """`param`'s slice of the optimizer state `key` := `value` (whole, the same on every rank)."""

    @abstractmethod
    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """`param`'s gradient := `value`, in `full_grad`'s terms (averaged, unscaled; whole, the same on every
        rank): this rank's part of the reduced gradient the step reads, where it waits for it ([Note: setting a
        gradient]). Between the accumulation boundary's backward and `step()`; no collective."""

    def _state_of(self, master: torch.Tensor, key: str) -> torch.Tensor:
        """Optimizer state `key` of a master tensor, or an error naming the key when the optimizer has none."""
        state = self.optimizer.state.get(master, {}) if self.optimizer is not None else {}
        if key not in state:
            raise KeyError(f"optimizer state {key!r} does not exist (yet): the optimizer creates it at its first step")
        value: torch.Tensor = state[key]
        return value

    def _grad_scale(self) -> float:
        """Turns a reduced gradient shard into the true mean gradient (as the step's scale, without clipping)."""
        return self.step_policy.post_scale(self.comm.world_size) / self.accumulation.loss_scale

    def _unscaled(
        self, value: torch.Tensor, numel: int, dtype: torch.dtype, call: str = "safe_set_full_grad"
    ) -> torch.Tensor:
        """`value` set as a gradient, as the shards hold it: `shard_gradient` at this step's scale."""
        return shard_gradient(value, numel, dtype, self._grad_scale(), call)

    def _has_state(self, key: str) -> bool:
        """Whether the optimizer holds state `key` on any rank (decided together, so every rank gathers or none)."""
        here = self.optimizer is not None and any(key in state for state in self.optimizer.state.values())
        return self.comm.any_true(here, self.device)

    # -- gathering (GatheredParameters) ------------------------------------------------------------------
    def gather_begin(
        self, params: Sequence[torch.Tensor], call: str = "", modifier_rank: int | None = None
    ) -> list[Any]:
        """Make `params` whole until `gather_end` (collective; `call` names the caller's call in a divergence
        report, `modifier_rank` is the rank whose changes `gather_end` will broadcast); returns what to release.
        Stages 0-2: nothing."""
        return []

    def gather_end(self, held: list[Any], modifier_rank: int | None) -> None:
        """Release what `gather_begin` returned; with `modifier_rank`, that rank's values become everyone's."""
        return None

    # -- state, checkpoints, gathering -------------------------------------------------------------------
    @abstractmethod
    def checkpoint_state(self) -> ShardedState:
        """This strategy in the checkpoint format's terms ([Note: strategy adapters])."""

    def full_state_dict(self) -> dict[str, Any]:
        """The module's state_dict with whole tensors in the compute dtype (collective; `save_16bit_model`). The
        zero stages' module already gives that (stage 3's state_dict hooks gather)."""
        return self.module.state_dict()

    def save_state_dict(self, keep: bool) -> dict[str, Any]:
        """`save_16bit_model`'s weights on the ranks that `keep` them (collective: every rank takes part)."""
        state = self.full_state_dict()
        return state if keep else {}

    def whole_state_dict(self, exclude_frozen: bool) -> dict[str, Any] | None:
        """The whole model under names `consolidated_params` cannot give, in the compute dtype on the host (every
        rank holds all of it; collective); None where the consolidated parameters name the whole model. Only MoE
        layers' experts at stage 3 need it: they are named per rank ([Note: expert checkpoints])."""
        return None

    @abstractmethod
    def gathered(self) -> AbstractContextManager[None]:
        """Full parameters for the block (stage 3 gathers every unit; others are always whole)."""

    # `master_param_groups()` holds a user group once per part (split strategies, MoE experts at stage 3): a client
    # optimizer's groups are then replaced, options kept, rather than paired with these by position
    regroups: bool = False

    def window_change_refused(self, gradient_accumulation_steps: int) -> str | None:
        """Why the accumulation window cannot become `gradient_accumulation_steps` micro-steps now (None: it can)."""
        return None

    # -- [Note: coalesced gradient reduction] ---------------------------------------------------------------
    # DeepSpeed 0.19's `engine.coalesce_grad_reduction()`: the backwards inside the block (several micro-batches,
    # one optimizer step after it) communicate nothing, and leaving the block reduces their summed gradients once.
    # Stages 1-2 leave the gradients in `.grad`, where autograd sums them, and reduce them at the end as one more
    # backward would ([Note: gradients outside engine.backward]); stage 3 keeps each unit's staging buffer (in
    # the reduction's dtype) over the block, adding each backward's gradients into it, and reduce-scatters every
    # unit once at the end. The block holds a whole gradient per rank (DeepSpeed's keeps it on the parameters). The
    # result is the one those backwards give uncoalesced ([Note: a second backward]) up to rounding, with one
    # reduction instead of one per backward at stages 2-3; in bf16 the block's gradients are summed in bf16 (stages
    # 1-2: `.grad`; stage 3: the reduction's dtype), not in `data_types.grad_accum_dtype`, as DeepSpeed sums them on
    # the parameters. Off the accumulation boundary the flush reduces anyway (as DeepSpeed's). `engine.zero_grad()`
    # inside a block, or a block that raises, drops the held gradients without communicating. Refused: stage 0 (as
    # DeepSpeed), caller-owned windows, a PipelineModule, the fsdp2 backend, super_offload; `engine.step()` inside.
    def coalescing_refused(self) -> str | None:
        """Why this strategy cannot hold a block's gradients back for one reduction (None: it can)."""
        return None

    def flush_coalesced(self) -> None:
        """The block ended: reduce what its backwards left unreduced, once (collective)."""
        self.finish_backward()

    def take_module_params(self, src: int) -> None:
        """`load_module_state_dict` wrote each rank's module parameters: rank `src`'s values become every rank's and
        the master weights follow (collective). Whole parameters (stages 0-2) are broadcast here, each over the group
        that holds it alike (`src` a rank of that group: tensor parallelism's data-parallel group, each tensor-parallel
        rank its own slice; MoE experts' expert-data-parallel group); strategies that shard parameters took them
        through GatheredParameters's `modifier_rank` and override this with nothing."""
        with torch.no_grad():
            for param in self.module.parameters():
                local = param.data.to_local() if isinstance(param.data, DTensor) else param.data
                data = local if local.is_contiguous() else local.contiguous()
                comm = self.holders(param)
                comm.broadcast(data, src=comm.global_rank(src), label="load_module_state_dict")
                if data is not local:
                    local.copy_(data)
        for part in self.checkpoint_state().parts():
            with part.hold(True):
                part.refresh_master()

    def refuse_offloaded(self, what: str) -> None:
        """A call that reads or writes model states, while `offload_states()` holds some of them elsewhere."""
        if self.offloaded:
            raise ZeroshardError(
                f"{what}: {', '.join(sorted(self.offloaded))} offloaded by offload_states(); call "
                "engine.reload_states() first"
            )

    def refuse_away(self, what: str, kinds: Collection[str]) -> None:
        """A call that uses the `kinds` of state (the parameters, the gradient buffers) `offload_states()` holds."""
        away = sorted(self.offloaded & set(kinds))
        if away:
            raise ZeroshardError(
                f"{what}: {', '.join(away)} offloaded by offload_states(); call engine.reload_states() first"
            )

    def holders(self, param: torch.Tensor) -> Collectives:
        """The ranks that hold `param` alike (its reductions' group)."""
        return self.comm

    def module_load_refused(self) -> str | None:
        """Why `load_module_state_dict` cannot load into this strategy's module (None: it can)."""
        return None

    def discard_module_changes(self) -> None:
        """The module's parameters := the master weights again (collective): undoes a module load that failed part
        of the way. Where the masters are the parameters (fp32 stage 0), the partial load stays."""
        self.checkpoint_state().publish_params()

    def release_gathered(self) -> None:
        """`engine.empty_partition_cache()`: give back every gathered parameter that no block holds (stage 3: what a
        forward without a backward left gathered); stages 0-2 hold nothing gathered."""
        return None

    @abstractmethod
    def optimizer_state_resident(self) -> AbstractContextManager[None]:
        """Master weights and optimizer state in memory for the block (NVMe: read in, written back after)."""

    def consolidation_refused(self) -> str | None:
        """Why `consolidated_params` would not give the whole model here (None: it does)."""
        return None

    TP_SLICES: Final = "tensor-parallel weights are slices here (only the local ones would be gathered)"

    @abstractmethod
    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        """Full master values of every trainable parameter by id(param), in `dtype` (collective). `keep` False:
        this rank takes part and keeps nothing ({}); `device`: where the kept values go, each as soon as it is
        whole (e.g. the CPU on one rank for an export), else the compute device."""

    @abstractmethod
    def offloadable(self) -> dict[str, list[torch.Tensor]]:
        """What `engine.offload_states()` may move, by DeepSpeed's kind of state ([Note: offloaded states])."""

    def offload_refused(self, kinds: Sequence[str]) -> str | None:
        """Why `engine.offload_states()` cannot move `kinds` now (None: it can)."""
        return None

    def show_params(self, away: bool, host_view: HostView | None = None) -> None:
        """`lp_params` left (`away`: the module's parameters become `host_view`'s views of the host copies) or came
        back (their device views again); nothing to do where `offloadable` names no parameters."""
        return None

    def release_buffers(self) -> None:
        """`contiguous_grad_buffer`: free the pooled communication buffers (allocated again when next used)."""
        return None

    @abstractmethod
    def tracked_params(self) -> list[nn.Parameter]:
        """Parameters whose storage the strategy manages."""

    @property
    @abstractmethod
    def trainable_numel(self) -> int: ...

    @abstractmethod
    def memory(self) -> StrategyMemory:
        """Bytes held on this rank, by kind."""

    @abstractmethod
    def destroy(self) -> None:
        """Remove every hook, close the swap files, release buffers."""
