"""A model's parameters in several `FlatStrategy` parts sharing one optimizer.

[Note: split flat strategies]
Some compositions need different parameters treated differently at the same ZeRO stage: MoE experts reduce over
their expert-data-parallel group ([Note: experts under ZeRO] in moe/zero.py), tensor-parallel shards count in the
norm differently from the parameters every tensor-parallel rank holds whole ([Note: tensor-parallel norm] in
tp/zero.py). Each part is an ordinary `FlatStrategy` over its own parameter groups; this base runs the common step
skeleton over all of them (one norm, one scale) and forwards everything else to the part that owns a parameter.
Subclasses build `self.parts` and say how their norms and checkpoints combine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.memory import StrategyMemory
from zeroshard.offload.gradients import GradShard
from zeroshard.optim.lamb import refuse_unplanned
from zeroshard.zero.flat.strategy import FlatPolicy, FlatStrategy
from zeroshard.zero.owners import OWNERS
from zeroshard.zero.strategy import (
    AccumulationState,
    HostView,
    ParamGroupSpec,
    Strategy,
    held,
    optimizer_state_tensors,
)


def split_groups(
    groups: Sequence[ParamGroupSpec], chosen: set[int]
) -> tuple[list[ParamGroupSpec], list[ParamGroupSpec]]:
    """(the groups without the parameters in `chosen`, the groups of only those); empty groups dropped."""
    rest = [ParamGroupSpec(g.options, [(n, p) for n, p in g.params if id(p) not in chosen]) for g in groups]
    picked = [ParamGroupSpec(g.options, [(n, p) for n, p in g.params if id(p) in chosen]) for g in groups]
    return [g for g in rest if g.params], [g for g in picked if g.params]


def flat_parts(
    module: nn.Module,
    parts: Sequence[tuple[list[ParamGroupSpec], FlatPolicy, Collectives]],
    device: torch.device,
    accumulation: AccumulationState,
) -> list[FlatStrategy]:
    """A `FlatStrategy` per (groups, policy, comm) in `parts`; only the first keeps the bystanders ([Note: clipping
    over the whole module at stage 0] in zero/flat/bystanders.py)."""
    everything = [ParamGroupSpec({}, list(module.named_parameters()))]
    built = []
    for i, (groups, policy, comm) in enumerate(parts):
        others = [g for j, part in enumerate(parts) if j != i for g in part[0]]
        built.append(FlatStrategy(module, groups, policy, comm, device, accumulation, others if i == 0 else everything))
    return built


class SplitStrategy(Strategy):
    """[Note: split flat strategies] the delegation to `self.parts` (built by the subclass)."""

    parts: list[FlatStrategy]
    regroups = True

    def _hold(self, parts: list[FlatStrategy]) -> list[FlatStrategy]:
        """`parts` become this strategy's, and DeepSpeed's per-parameter calls find it rather than a part ([Note:
        parameter registry]): a part's gradient scale is its own group's, the true one the whole split's (experts)."""
        self.parts = parts
        OWNERS.register(self, self.tracked_params())
        return parts

    # -- construction ----------------------------------------------------------------------------------
    def master_param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.master_param_groups()]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        refuse_unplanned(optimizer, "tensor parallelism, MoE experts or torch_autocast (a split flat strategy)")
        self.optimizer = optimizer
        for part in self.parts:  # each steps its own groups: the others' masters have no .grad then
            part.attach(optimizer)

    # -- backward and step -------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        for part in self.parts:
            part.begin_backward()

    def finish_backward(self) -> None:
        for part in self.parts:
            part.finish_backward()

    def end_window(self) -> None:
        for part in self.parts:
            part.end_window()

    def flush_coalesced(self) -> None:
        for part in self.parts:
            part.flush_coalesced()

    @property
    def _sharded(self) -> bool:
        return any(part._sharded for part in self.parts)

    def _before_step(self) -> None:
        for part in self.parts:
            part._before_step()

    def _grad_slots(self) -> list[GradShard]:
        return [slot for part in self.parts for slot in part._grad_slots()]

    def _extra_norms(self) -> list[torch.Tensor]:
        return [n for part in self.parts for n in part._extra_norms()]

    def _land_gradients(self) -> None:
        # each part copies its gradients to the host on its own stream (its tier's), which the step must wait for
        for part in self.parts:
            part._land_gradients()

    def _step_chunks(self, scale: float) -> None:
        for part in self.parts:
            part._step_chunks(scale)

    def _publish(self) -> None:
        for part in self.parts:
            part._publish()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def publish_params(self) -> None:
        """Every rank's master shards become the module's weights (after a checkpoint load)."""
        for part in self.parts:
            part.publish_params()

    @property
    def offloaded(self) -> frozenset[str]:
        """engine.offload_states() on the parts too: the parameter registry names a part as a parameter's owner."""
        return self._offloaded

    @offloaded.setter
    def offloaded(self, value: frozenset[str]) -> None:
        self._offloaded = value
        for part in getattr(self, "parts", []):  # (Strategy.__init__ sets it before the parts exist)
            part.offloaded = value

    # -- one parameter ---------------------------------------------------------------------------------------
    def holders(self, param: torch.Tensor) -> Collectives:
        owner = next((p for p in self.parts if any(t is param for t in p.tracked_params())), None)
        return owner.comm if owner is not None else self.comm  # untracked (frozen): the first part's group

    def _owner(self, param: torch.Tensor) -> FlatStrategy:
        return next(p for p in self.parts if any(t is param for t in p.tracked_params()))

    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor:
        return self._owner(param).full_fp32_param(param)

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._owner(param).full_grad(param)

    def full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        return self._owner(param).full_optimizer_state(param, key)

    def set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        self._owner(param).set_full_fp32_param(param, value)

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        self._owner(param).set_full_optimizer_state(param, value, key)

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        self._owner(param).set_full_grad(param, value)

    # -- state ---------------------------------------------------------------------------------------------
    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield

    @contextmanager
    def optimizer_state_resident(self) -> Iterator[None]:
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.optimizer_state_resident())
            yield

    def consolidation_refused(self) -> str | None:
        return next((why for part in self.parts if (why := part.consolidation_refused())), None)

    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.consolidated_params(dtype, keep, device).items()}

    def offloadable(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, dict[int, torch.Tensor]] = {}
        for part in self.parts:  # the shared optimizer's state once
            for kind, tensors in part.offloadable().items():
                out.setdefault(kind, {}).update({id(t): t for t in tensors})
        return {kind: list(tensors.values()) for kind, tensors in out.items()}

    def show_params(self, away: bool, host_view: HostView | None = None) -> None:
        for part in self.parts:
            part.show_params(away, host_view)

    def release_buffers(self) -> None:
        for part in self.parts:
            part.release_buffers()

    def tracked_params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.tracked_params()]

    @property
    def trainable_numel(self) -> int:
        return sum(part.trainable_numel for part in self.parts)

    def memory(self) -> StrategyMemory:
        total = StrategyMemory()
        for part in self.parts:
            for name, value in part.memory().as_dict().items():
                setattr(total, name, getattr(total, name) + value)
        # every part counted the shared optimizer's state, where its tier keeps it (the device, or the host with
        # offload_optimizer): take the extra counts off the same fields
        extra = (len(self.parts) - 1) * sum(held(t) for t in optimizer_state_tensors(self.optimizer))
        counted = StrategyMemory()
        self.parts[0].policy.master_tier.count_state(counted, 0, extra)
        for name, value in counted.as_dict().items():
            setattr(total, name, getattr(total, name) - value)
        return total

    def destroy(self) -> None:
        for part in self.parts:
            part.destroy()
