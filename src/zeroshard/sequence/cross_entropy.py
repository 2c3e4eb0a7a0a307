"""`deepspeed.sequence.cross_entropy`: cross entropy over logits sharded by vocabulary (and sequence).

[Note: vocabulary-parallel cross entropy]
A column-parallel LM head that does not gather its output leaves each tensor-parallel rank the logits of its
vocabulary shard ([Note: vocabulary shards]); gathering them costs tokens x vocabulary per rank. The loss needs
only three numbers per token from across the group: the largest logit (a MAX all-reduce), the sum of the shifted
exponentials and the target's logit (SUM all-reduces; the rank holding the target contributes it, the others 0).
Every rank then holds the same per-token loss, and since every rank back-propagates that same loss, each local
logit's gradient (softmax - onehot) x upstream needs no communication. The arithmetic, in that order, is DeepSpeed
0.19.8's PyTorch backend's, so loss and gradient equal its to the bit (`tests/distributed/test_vocab_parallel_ce.py`).
Unlike DeepSpeed, forward keeps the logits it was given (and one max and one sum per token) instead of an fp32
copy of their exponentials, and backward recomputes them in place: 4 bytes per logit less between forward and
backward where the caller holds the logits anyway (what `benchmarks/vocab_ce_memory.py` measures), 2 for bf16
logits the caller drops, none for fp32 ones it drops; backward holds one fp32 copy where DeepSpeed's holds two.
Two consequences: the logits must not be changed in place between forward and backward (autograd's version
check says so; DeepSpeed's saved exponentials do not mind), and the backward is once-differentiable.

Sequence parallelism adds a leading sequence dimension split over `sp_group`: `reduction` "sum"/"mean" sum over it
(the mean divides by the valid tokens of the whole sequence), and "none" with `gather_sequence_loss` all-gathers the
per-token losses ("none" otherwise returns this rank's slice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from zeroshard.sequence.vocab_shard import VocabShard, check_ids_in_vocab, group_collectives, resolve_vocab_shard
from zeroshard.utils.logging import warning_once

REDUCTIONS = ("none", "sum", "mean")
BACKENDS = ("torch", "liger")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses of vocabulary-sharded logits; ignored tokens give 0 loss and 0 gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp_group: Any, shard: VocabShard, ignore_index: int
    ) -> torch.Tensor:
        comm = group_collectives(tp_group)
        target = target.to(dtype=torch.long)
        full = logits.float()
        global_max = full.amax(dim=-1).clone()
        if comm is not None:
            comm.all_reduce(global_max, op="max", label="vocab-parallel CE max")
        sum_exp = torch.sub(full, global_max.unsqueeze(-1)).exp_().sum(dim=-1)
        if comm is not None:
            comm.all_reduce(sum_exp, label="vocab-parallel CE sum")
        valid = target != ignore_index
        held = valid & (target >= shard.start) & (target < shard.end)
        local_target = (target - shard.start).clamp(min=0, max=full.shape[-1] - 1)
        target_logit = full.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(held, target_logit, torch.zeros_like(target_logit))
        if comm is not None:
            comm.all_reduce(target_logit, label="vocab-parallel CE target logit")
        loss = torch.log(sum_exp) + global_max - target_logit
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        ctx.save_for_backward(logits, global_max, sum_exp, local_target, held, valid)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, global_max, sum_exp, local_target, held, valid = ctx.saved_tensors
        # forward's exponentials recomputed, in place: one fp32 [rows, vocab] tensor (DeepSpeed's backward holds two)
        grad = torch.sub(logits.float(), global_max.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -held.unsqueeze(-1).to(dtype=grad.dtype))
        grad *= valid.unsqueeze(-1).to(dtype=grad.dtype)
        grad *= grad_output.to(dtype=grad.dtype).unsqueeze(-1)
        return grad.to(dtype=logits.dtype), None, None, None, None


class _GatherSequenceLoss(torch.autograd.Function):
    """Per-token losses of every sequence shard, concatenated along dim 0. Backward either sums each shard's
    gradient over the ranks (`sum_gradients`: every rank's loss reads every shard) or keeps this rank's slice
    (DeepSpeed's older `vocab_sequence_parallel_cross_entropy`: each rank back-propagates only its own tokens)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, sp_group: Any, sum_gradients: bool) -> torch.Tensor:  # type: ignore[override]
        comm = group_collectives(sp_group)
        ctx.comm, ctx.rows, ctx.sum_gradients = comm, local.shape[0], sum_gradients
        if comm is None:
            return local.clone()
        whole = local.new_empty((local.shape[0] * comm.world_size, *local.shape[1:]))
        comm.all_gather(whole, local.contiguous(), label="sequence-parallel loss gather")
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        comm = ctx.comm
        if comm is None:
            return grad, None, None
        if not ctx.sum_gradients:
            return grad.narrow(0, comm.rank * ctx.rows, ctx.rows), None, None
        mine = grad.new_empty((ctx.rows, *grad.shape[1:]))
        comm.reduce_scatter(mine, grad.contiguous(), label="sequence-parallel loss gradient")
        return mine, None, None


def _sequence_sum(local: torch.Tensor, sp_group: Any) -> torch.Tensor:
    """`local` summed over the sequence-parallel ranks, with the gradient of `local` itself flowing back (each
    rank's loss differentiates its own tokens)."""
    comm = group_collectives(sp_group)
    if comm is None:
        return local
    total = local.detach().clone()
    comm.all_reduce(total, label="sequence-parallel loss sum")
    return local + (total - local.detach())


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"vocabulary-parallel cross entropy: backend {backend!r} is unknown; choose from {BACKENDS}")
    if backend == "liger":
        warning_once(
            "vocabulary-parallel cross entropy: zeroshard has no Liger kernel; backend='liger' runs the PyTorch path "
            "(DeepSpeed's fallback where Liger cannot run)"
        )


def _check_reduction(reduction: str, gather_sequence_loss: bool, sp_group: Any) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocabulary-parallel cross entropy: reduction {reduction!r} is unknown; choose {REDUCTIONS}")
    if gather_sequence_loss and reduction != "none":
        raise ValueError("gather_sequence_loss=True needs reduction='none' (the per-token losses it gathers)")
    if gather_sequence_loss and sp_group is None:
        raise ValueError("gather_sequence_loss=True needs sp_group, the group the sequence is split over")


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Any = None,
    sp_group: Any = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    global_vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    gather_sequence_loss: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """Cross entropy of logits whose last dimension is split over `tp_group` ([Note: vocabulary-parallel cross
    entropy]); `target` has the logits' other dimensions and is the same on every tensor-parallel rank. Without
    `vocab_start_index`/`vocab_end_index` the shards are equal and in rank order. `global_vocab_size` (with explicit
    bounds) skips the layout check's collective for a layout the caller already checked.

    >>> import torch
    >>> logits, target = torch.randn(4, 10), torch.tensor([1, 2, -100, 9])
    >>> loss = vocab_parallel_cross_entropy(logits, target)  # no tp_group: the whole vocabulary
    >>> torch.allclose(loss, torch.nn.functional.cross_entropy(logits, target))
    True
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocabulary-parallel cross entropy: logits {tuple(vocab_parallel_logits.shape)} and target "
            f"{tuple(target.shape)} must share every dimension but the vocabulary"
        )
    _check_reduction(reduction, gather_sequence_loss, sp_group)
    _check_backend(backend)
    if vocab_parallel_logits.shape[-1] == 0 and group_collectives(tp_group) is None:  # a group checks it together
        raise ValueError("vocabulary-parallel cross entropy: the logits hold no vocabulary entry (last dimension 0)")
    shard = _shard(vocab_parallel_logits, tp_group, vocab_start_index, vocab_end_index, global_vocab_size)
    check_ids_in_vocab(target, ignore_index, shard.vocab_size, "target", sp_group)
    loss = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, shard, ignore_index)
    if reduction == "none":
        return _GatherSequenceLoss.apply(loss, sp_group, True) if gather_sequence_loss else loss
    total = _sequence_sum(loss.sum(), sp_group)
    if reduction == "sum":
        return total
    valid = (target != ignore_index).sum().to(dtype=loss.dtype)
    comm = group_collectives(sp_group)
    if comm is not None:
        comm.all_reduce(valid, label="sequence-parallel valid tokens")
    return total / valid.clamp_min(1)


def _shard(
    logits: torch.Tensor, tp_group: Any, start: int | None, end: int | None, vocab_size: int | None
) -> VocabShard:
    if vocab_size is None:
        return resolve_vocab_shard(logits.shape[-1], start, end, tp_group, logits.device)
    if start is None or end is None:
        raise ValueError("global_vocab_size needs explicit vocab_start_index and vocab_end_index")
    return VocabShard(start, end, vocab_size)


def vocab_sequence_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    sp_group: Any,
    tp_group: Any = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    ignore_index: int = -100,
    reduction: str = "none",
    gather_sequence_loss: bool = True,
    backend: str = "torch",
) -> torch.Tensor:
    """DeepSpeed's older sequence-parallel loss (Megatron-DeepSpeed's `[s/sp, b, v]` logits): the per-token losses
    of the whole sequence, gathered over `sp_group`, whose backward keeps this rank's slice of the gradient."""
    _check_reduction(reduction, gather_sequence_loss, sp_group)
    loss = vocab_parallel_cross_entropy(
        vocab_parallel_logits,
        target,
        tp_group=tp_group,
        sp_group=sp_group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        ignore_index=ignore_index,
        reduction=reduction,
        backend=backend,
    )
    return _GatherSequenceLoss.apply(loss, sp_group, False) if gather_sequence_loss else loss


class VocabParallelCrossEntropyLoss(nn.Module):
    """`vocab_parallel_cross_entropy` as a module, its arguments fixed at construction."""

    def __init__(
        self,
        tp_group: Any = None,
        sp_group: Any = None,
        vocab_start_index: int | None = None,
        vocab_end_index: int | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        gather_sequence_loss: bool = False,
        backend: str = "torch",
    ):
        super().__init__()
        self.tp_group, self.sp_group = tp_group, sp_group
        self.vocab_start_index, self.vocab_end_index = vocab_start_index, vocab_end_index
        self.ignore_index, self.reduction = ignore_index, reduction
        self.gather_sequence_loss, self.backend = gather_sequence_loss, backend

    def forward(self, vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            vocab_parallel_logits,
            target,
            tp_group=self.tp_group,
            sp_group=self.sp_group,
            vocab_start_index=self.vocab_start_index,
            vocab_end_index=self.vocab_end_index,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            gather_sequence_loss=self.gather_sequence_loss,
            backend=self.backend,
        )


class VocabParallelCausalLMLoss:
    """A Hugging Face `loss_function` (`ForCausalLMLoss`'s call: `logits, labels, vocab_size, num_items_in_batch,
    shift_labels`) over vocabulary-sharded logits ([Note: vocabulary-parallel cross entropy]). One instance
    serves one shard: its layout is checked on the first call (a collective) and then held; a later call with
    another local vocabulary size or group is refused. Leave `sp_group` None under the engine's Ulysses sequence
    parallelism, which weights each shard's mean by its tokens itself."""

    def __init__(
        self,
        tp_group: Any = None,
        sp_group: Any = None,
        vocab_start_index: int | None = None,
        vocab_end_index: int | None = None,
        ignore_index: int = -100,
        backend: str = "torch",
    ):
        self.tp_group, self.sp_group = tp_group, sp_group
        self.vocab_start_index, self.vocab_end_index = vocab_start_index, vocab_end_index
        self.ignore_index, self.backend = ignore_index, backend
        self._layout: tuple[Any, ...] | None = None
        self._shard: VocabShard | None = None

    def shard(self, local_size: int, device: torch.device) -> VocabShard:
        """The checked layout of this instance's shard (resolved on the first call)."""
        key = (self.tp_group, device, local_size, self.vocab_start_index, self.vocab_end_index)
        if self._shard is None:
            self._shard = resolve_vocab_shard(
                local_size, self.vocab_start_index, self.vocab_end_index, self.tp_group, device
            )
            self.vocab_start_index, self.vocab_end_index = self._shard.start, self._shard.end
            self._layout = (self.tp_group, device, local_size, self._shard.start, self._shard.end)
        elif key != self._layout:
            raise RuntimeError(
                "VocabParallelCausalLMLoss: the vocabulary shard changed after the first call; make one instance "
                "per shard (a teacher and a student each need their own)"
            )
        return self._shard

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            if labels is None:
                raise ValueError("VocabParallelCausalLMLoss: pass labels or shift_labels")
            shift_labels = labels[..., 1:].contiguous()
            logits = logits[..., :-1, :].contiguous()
        else:
            shift_labels = shift_labels.contiguous()
        shard = self.shard(logits.shape[-1], logits.device)
        if vocab_size is not None and vocab_size != shard.vocab_size:
            warning_once(
                f"vocabulary-parallel LM head: its shards hold {shard.vocab_size} ids but the model says "
                f"vocab_size={vocab_size} (a resized embedding?); the head's layout is used"
            )
        loss = vocab_parallel_cross_entropy(
            logits,
            shift_labels,
            tp_group=self.tp_group,
            sp_group=self.sp_group,
            vocab_start_index=shard.start,
            vocab_end_index=shard.end,
            global_vocab_size=shard.vocab_size,
            ignore_index=self.ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
            backend=self.backend,
        )
        if num_items_in_batch is None:
            return loss
        items = torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype)
        return loss / items.clamp_min(1)


def install_loss_function(model: nn.Module, loss_fn: Any) -> Any:
    """Set `model.loss_function` (the hook Hugging Face causal LMs call with their logits); the previous one."""
    if not hasattr(model, "loss_function"):
        raise ValueError(
            f"{type(model).__name__} has no loss_function hook for a vocabulary-parallel LM head's loss; gather the "
            "head's logits instead (gather_output=True, or no vocab_parallel_lm_head)"
        )
    previous = model.loss_function
    registered = model._modules.pop("loss_function", None)  # an nn.Module loss would shadow the attribute
    try:
        model.loss_function = loss_fn
    except (AttributeError, TypeError) as error:
        if registered is not None:
            model.loss_function = registered
        raise ValueError(
            f"{type(model).__name__}.loss_function cannot be replaced ({error}); gather the head's logits instead"
        ) from error
    if model.loss_function is not loss_fn:
        model.loss_function = previous
        raise ValueError(
            f"{type(model).__name__}.loss_function ignores assignment; gather the head's logits instead "
            "(gather_output=True, or no vocab_parallel_lm_head)"
        )
    return previous


def validate_vocab_parallel_loss(model: nn.Module) -> None:
    """Check that `model.loss_function` can be replaced, leaving it as it was (before any weight is split)."""
    model.loss_function = install_loss_function(model, VocabParallelCausalLMLoss())


def configure_vocab_parallel_loss(
    model: nn.Module, vocab_parallel_head: Any, sp_group: Any = None, ignore_index: int = -100, backend: str = "torch"
) -> nn.Module:
    """Make `model.loss_function` the vocabulary-parallel causal-LM loss of `vocab_parallel_head` (anything with
    DeepSpeed's `mp_group`, `vocab_start_index`, `vocab_end_index`); the stock loss stays reachable as
    `model._deepspeed_original_loss_function`."""
    loss_fn = VocabParallelCausalLMLoss(
        tp_group=vocab_parallel_head.mp_group,
        sp_group=sp_group,
        vocab_start_index=vocab_parallel_head.vocab_start_index,
        vocab_end_index=vocab_parallel_head.vocab_end_index,
        ignore_index=ignore_index,
        backend=backend,
    )
    previous = install_loss_function(model, loss_fn)
    if not hasattr(model, "_deepspeed_original_loss_function"):
        model._deepspeed_original_loss_function = previous
    return model
