"""Stages 0-2's whole values for the caller: one parameter's (DeepSpeed's `safe_get_full_*` / `safe_set_full_*`) and
the consolidated state dict. A base of `FlatStrategy`; at stages 1-2 the reads all-gather master, gradient or optimizer
state shards, so they agree first ([Note: gathering calls agree first] in comm/agreement.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.zero.flat.group_buffers import GroupBuffers
from zeroshard.zero.flat.local import is_dtensor, local_of
from zeroshard.zero.flat.reducer import GradientReducer
from zeroshard.zero.layout import Bucket, FlatLayout
from zeroshard.zero.strategy import Strategy


class FlatFullValues(Strategy):
    """Whole values from the flat buffers; the buffers, layout and reducer are the strategy's."""

    buffers: list[GroupBuffers]
    layout: FlatLayout
    reducer: GradientReducer
    shard_rank: int
    _copied: set[int]  # buckets whose host gradient copy backward refreshed

    def consolidation_refused(self) -> str | None:
        if any(is_dtensor(p) for b in self.buffers for p in b.params):
            return self.TP_SLICES
        return None

    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        if self._sharded:
            buckets = sum(len(b.layout.buckets) for b in self.buffers)
            self.agreement.agree(
                "the consolidated state dict", f"all-gather of the fp32 master shards of {buckets} buckets"
            )
        with self.optimizer_state_resident():
            out: dict[int, torch.Tensor] = {}
            for buffers in self.buffers:
                layout = buffers.layout
                for bucket in layout.buckets:  # a bucket at a time: a whole group's fp32 copy was on the device
                    full = self._full_master(buffers, bucket)
                    for slot in (layout.slots[i] for i in bucket.slots) if keep else ():
                        param = buffers.params[slot.index]
                        value = full.narrow(0, slot.offset - bucket.start, slot.numel).view(local_of(param).shape)
                        out[id(param)] = value.to(device or self.device, dtype, copy=True)
            return out

    def _full_master(self, buffers: GroupBuffers, bucket: Bucket) -> torch.Tensor:
        """The whole fp32 master values of one bucket (a parameter lies in one bucket)."""
        if buffers.layout.numel == buffers.layout.shard_numel:
            return buffers.master.narrow(0, bucket.start, bucket.numel).to(self.device, torch.float32)
        full = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
        # fp32 in and out (NCCL gathers one dtype): [Note: bf16 master weights]
        mine = buffers.master.narrow(0, bucket.shard_start, bucket.shard_numel).to(self.device, torch.float32)
        self.comm.all_gather(full, mine)
        return full

    # -- one parameter's full values ([Note: parameter registry]) -------------------------------------------
    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor:
        self._agree_slot("safe_get_full_fp32_param", param, "fp32 master")
        with self.optimizer_state_resident():
            return self._gather_slot(param, lambda buffers: buffers.master)

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        self._agree_slot("safe_get_full_grad", param, "gradient")
        if self.reducer.window_unreduced:  # stages 0-1 mid-window: this rank's own accumulation, as DeepSpeed's
            buffers, slot = self._slot_of(param)
            local = self.reducer.local_accumulation(self.buffers.index(buffers), slot.offset, slot.numel)
            return (local.to(self.device) / self.accumulation.loss_scale).view(local_of(param).shape)
        self.reducer.settle()
        return self._gather_slot(param, lambda buffers: buffers.grad_shard, self._grad_scale())

    def full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        # `_has_state` is itself a collective (at stage 0 too): agreed with the gather that follows it
        self._agree_slot("safe_get_full_optimizer_state", param, f"optimizer state {key!r}", checks_state=True)
        if not self._has_state(key):
            return None
        with self.optimizer_state_resident():
            return self._gather_slot(param, lambda buffers: self._state_of(buffers.master, key))

    def set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        with self.optimizer_state_resident():
            self._scatter_slot(param, value, lambda buffers: buffers.master)
        with torch.no_grad():
            local_of(param).copy_(value)  # whole on every rank: the compute copy (the master itself when they alias)

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        with self.optimizer_state_resident():
            self._scatter_slot(param, value, lambda buffers: self._state_of(buffers.master, key))

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        if self.reducer.window_unreduced:  # stages 0-1 reduce a window once, at its end
            raise ZeroshardError(
                "safe_set_full_grad: this window's gradients are not reduced yet (stages 0-1 reduce a window at its "
                "end); set them after the accumulation boundary's backward, before engine.step() (with "
                "managed_gradient_accumulation false, step() reduces the window: set gradients at stage 2 or 3)"
            )
        self.reducer.settle()
        buffers, slot = self._slot_of(param)  # [Note: setting a gradient] in offload/gradients.py
        value = self._unscaled(value, slot.numel, buffers.grad_shard.dtype)
        self._scatter_slot(param, value, lambda b: b.grad_shard)
        self._copied -= {bucket.id for bucket in buffers.layout.buckets}  # the step copies the group again

    def _agree_slot(self, call: str, param: torch.Tensor, what: str, checks_state: bool = False) -> None:
        """Before a read of `param`'s whole `what`: the ranks agree on the parameter, the buckets gathered and what is
        read from them (a gradient and a master of the same parameter are gathers of the same sizes)."""
        if not (self._sharded or checks_state):
            return  # stage 0 reads its own whole copy
        buffers, slot = self._slot_of(param)
        steps = [f"a check for {what} on any rank"] if checks_state else []
        if self._sharded:
            ids = [
                b.id
                for b in buffers.layout.buckets
                if b.start < slot.offset + slot.numel and slot.offset < b.start + b.numel
            ]
            steps.append(f"all-gather of the {what} shards (group {self.buffers.index(buffers)}, buckets {ids})")
        self.agreement.agree(call, f"{'; '.join(steps)} of {slot.name}")

    def _slot_of(self, param: torch.Tensor) -> tuple[GroupBuffers, Any]:
        return next(
            (buffers, slot)
            for buffers in self.buffers
            for slot in buffers.layout.slots
            if buffers.params[slot.index] is param
        )

    def _scatter_slot(
        self, param: torch.Tensor, value: torch.Tensor, local: Callable[[GroupBuffers], torch.Tensor]
    ) -> None:
        """This rank's ranges of `local(buffers)` := the matching elements of `param`'s whole `value`."""
        buffers, slot = self._slot_of(param)
        target, flat = local(buffers), value.detach().reshape(-1)
        for bucket in buffers.layout.buckets:
            lo, hi = (
                bucket.owner_range(self.shard_rank) if self._sharded else (bucket.start, bucket.start + bucket.numel)
            )
            begin, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if begin < end:
                start = (bucket.shard_start if self._sharded else bucket.start) + begin - lo
                target.narrow(0, start, end - begin).copy_(flat[begin - slot.offset : end - slot.offset])

    def _gather_slot(
        self, param: torch.Tensor, local: Callable[[GroupBuffers], torch.Tensor], scale: float = 1.0
    ) -> torch.Tensor:
        """`param`'s part of a group-wide flat tensor of which `local(buffers)` is this rank's shard, in fp32 times
        `scale`: all-gathers the buckets that hold the parameter (none at stage 0). Only those buckets' pieces are
        converted and moved (the whole shard was: a host-to-device copy of an offloaded master per parameter)."""
        buffers, slot = self._slot_of(param)
        shard = local(buffers)

        def piece(start: int, numel: int) -> torch.Tensor:
            values = shard.narrow(0, start, numel).to(self.device, torch.float32, copy=True)
            return values * scale if scale != 1.0 else values

        if self.layout.shard_count == 1:
            return piece(slot.offset, slot.numel).view(local_of(param).shape)
        lo, hi = slot.offset, slot.offset + slot.numel
        out = torch.empty(slot.numel, dtype=torch.float32, device=self.device)
        for bucket in buffers.layout.buckets:
            start, end = bucket.start, bucket.start + bucket.numel
            if end <= lo or start >= hi:
                continue
            full = torch.empty(bucket.numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, piece(bucket.shard_start, bucket.shard_numel), label="full value")
            out[max(lo, start) - lo : min(hi, end) - lo].copy_(full[max(lo, start) - start : min(hi, end) - start])
        return out.view(local_of(param).shape)
