"""`deepspeed.sequence.linear_cross_entropy`: a vocabulary-parallel LM head and its loss without the logits.

[Note: fused head and loss over vocabulary shards]
Even split over the vocabulary, an LM head's logits are tokens x vocabulary / tp per rank (with a 152k vocabulary
at 8k tokens and tp 2, 2.5 GB in fp32). Here the projection is part of the loss ([Note: vocabulary-parallel cross
entropy]): forward computes the logits a block of tokens at a time and keeps per token only the global max and the
sum of exponentials (all-reduced per block: a max, then the sum and the target's logit in one tensor), and
backward recomputes them a block of vocabulary rows at a time, so each block of the weight's gradient is one GEMM
over all tokens. By default a block's fp32 logits are about the hidden states' size, whatever the vocabulary;
block sizes derive from the global layout so every rank issues the same collectives over uneven shards. The input
gradient is a partial sum over the rank's vocabulary, all-reduced in fp32 over the group as a column-parallel
layer's is. The GEMMs run in one compute dtype (autocast's if active, else the inputs' promotion); on devices with
mixed-precision GEMMs (fp16/bf16 in, fp32 out) the logits come out of the GEMM in fp32 directly. The arithmetic is
DeepSpeed 0.19.8's, so loss and gradients equal its to the bit (`tests/distributed/test_vocab_parallel_ce.py`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from zeroshard.sequence.cross_entropy import REDUCTIONS, _sequence_sum
from zeroshard.sequence.vocab_shard import check_ids_in_vocab, group_collectives, resolve_vocab_shard

_LOW = (torch.float16, torch.bfloat16)
_MIXED_GEMMS = ("aten::mm.dtype", "aten::addmm.dtype", "aten::addmm.dtype_out")


def default_chunk_rows(tokens: int, vocab_size: int, tp: int, hidden: int) -> int:
    """Tokens per forward block: a block's fp32 logits about as large as the hidden states (from the largest
    shard, so every rank computes the same count)."""
    blocks = max(1, math.ceil(math.ceil(vocab_size / tp) / hidden))
    return max(1, math.ceil(tokens / blocks))


@functools.cache
def _has_mixed_gemm(device_type: str) -> bool:
    """Whether the device registers GEMMs taking fp16/bf16 and writing fp32 (asked of the dispatcher: trying one
    could fail for unrelated reasons, out of memory among them). None in torch < 2.8, nor on the CPU."""
    try:
        key = torch._C._dispatch_key_for_device(device_type)
        return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for op in _MIXED_GEMMS)
    except (AttributeError, RuntimeError):
        return False


def _accumulate_matmul(accumulator: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    """`accumulator += mat1 @ mat2` in the accumulator's (fp32) dtype: accumulating blocks in low precision would
    make the gradient depend on the block size, and a low-precision block product can overflow."""
    if mat1.dtype == accumulator.dtype:
        accumulator.addmm_(mat1, mat2)
    elif accumulator.dtype == torch.float32 and mat1.dtype in _LOW and _has_mixed_gemm(accumulator.device.type):
        torch.addmm(accumulator, mat1, mat2, out_dtype=accumulator.dtype, out=accumulator)  # type: ignore[call-overload]
    else:
        accumulator.addmm_(mat1.to(accumulator.dtype), mat2.to(accumulator.dtype))


def _fp32_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """`hidden @ weight.T + bias + row_offset` in fp32 (`row_offset`: [tokens, 1]), the bias inside the GEMM as
    `F.linear` adds it, so a large product the bias cancels cannot overflow a low-precision output first."""
    if hidden.dtype in _LOW and _has_mixed_gemm(hidden.device.type):
        mm: Any = torch.addmm
        if bias is not None:
            logits = mm(bias.float(), hidden, weight.t(), out_dtype=torch.float32)
            return logits if row_offset is None else logits.add_(row_offset)
        if row_offset is not None:
            return mm(row_offset, hidden, weight.t(), out_dtype=torch.float32)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)  # type: ignore[call-arg]
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits if row_offset is None else logits.add_(row_offset)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        tp_group: Any,
        start: int,
        end: int,
        ignore_index: int,
        chunk_rows: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        comm = group_collectives(tp_group)
        tokens, local_vocab = hidden.shape[0], weight.shape[0]
        hidden_c, weight_c = hidden.to(compute_dtype), weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        valid = target != ignore_index
        held = valid & (target >= start) & (target < end)
        local_target = (target - start).clamp(0, local_vocab - 1)
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        row_max, row_sum_exp = torch.empty_like(loss), torch.empty_like(loss)
        for lo in range(0, tokens, chunk_rows):
            hi = min(lo + chunk_rows, tokens)
            logits = _fp32_logits(hidden_c[lo:hi], weight_c, bias_c)
            block_max = logits.amax(dim=-1)
            if comm is not None:
                comm.all_reduce(block_max, op="max", label="vocab-parallel linear CE max")
            logits.sub_(block_max.unsqueeze(-1))
            target_logit = logits.gather(-1, local_target[lo:hi].unsqueeze(-1)).squeeze(-1)
            target_logit = torch.where(held[lo:hi], target_logit, torch.zeros_like(target_logit))
            stats = torch.stack([logits.exp_().sum(dim=-1), target_logit], dim=-1)
            if comm is not None:
                comm.all_reduce(stats, label="vocab-parallel linear CE sums")
            sum_exp, target_logit = stats.unbind(-1)
            row_max[lo:hi], row_sum_exp[lo:hi] = block_max, sum_exp
            loss[lo:hi] = torch.where(valid[lo:hi], sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        ctx.save_for_backward(hidden, weight, bias, valid, held, local_target, row_max, row_sum_exp)
        ctx.comm, ctx.compute_dtype = comm, compute_dtype
        blocks = math.ceil(tokens / chunk_rows) if tokens else 1  # backward's blocks hold as many logits
        ctx.block_cols = max(1, math.ceil(local_vocab / blocks))
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, valid, held, local_target, row_max, row_sum_exp = ctx.saved_tensors
        dtype = ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        hidden_c = hidden.to(dtype)
        token_grad = torch.where(valid, grad_loss.float(), torch.zeros_like(row_max))
        prob_scale = (token_grad / row_sum_exp).unsqueeze(-1)  # softmax x upstream = exp(z - max) x this
        neg_row_max = -row_max.unsqueeze(-1)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if needs_hidden else None
        grad_weight = torch.empty_like(weight) if needs_weight else None
        grad_bias = torch.empty_like(bias) if needs_bias else None
        for lo in range(0, weight.shape[0], ctx.block_cols):
            hi = min(lo + ctx.block_cols, weight.shape[0])
            weight_block = weight[lo:hi].to(dtype)
            bias_block = None if bias is None else bias[lo:hi].to(dtype)
            grad_logits = _fp32_logits(hidden_c, weight_block, bias_block, neg_row_max).exp_().mul_(prob_scale)
            in_block = held & (local_target >= lo) & (local_target < hi)
            grad_logits[rows[in_block], local_target[in_block] - lo] -= token_grad[in_block]
            if grad_bias is not None:
                grad_bias[lo:hi] = grad_logits.sum(dim=0)
            grad_logits = grad_logits.to(dtype)
            if grad_weight is not None:
                grad_weight[lo:hi] = grad_logits.t() @ hidden_c
            if grad_hidden is not None:
                _accumulate_matmul(grad_hidden, grad_logits, weight_block)
        if grad_hidden is not None:
            if ctx.comm is not None:  # each rank saw its vocabulary only: partial sums, added in fp32
                ctx.comm.all_reduce(grad_hidden, label="vocab-parallel linear CE input gradient")
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    tp_group: Any = None,
    sp_group: Any = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross entropy of `hidden @ weight.T (+ bias)` over this rank's vocabulary rows `weight` ([local_vocab,
    hidden]) without the logits ([Note: fused head and loss over vocabulary shards]). `hidden` is the same on every
    tensor-parallel rank; `chunk_size` is tokens per forward block. "none" gives per-token losses in `target`'s
    shape (0 where ignored), not reduced over `sp_group`.

    >>> import torch
    >>> h, w, t = torch.randn(5, 4), torch.randn(9, 4), torch.tensor([0, 3, 8, -100, 2])
    >>> loss = vocab_parallel_linear_cross_entropy(h, w, t)
    >>> torch.allclose(loss, torch.nn.functional.cross_entropy(h @ w.T, t))
    True
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: reduction {reduction!r} is unknown; use {REDUCTIONS}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_linear_cross_entropy: hidden {tuple(hidden.shape)} and target {tuple(target.shape)} "
            "must share every dimension but the hidden one"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"vocab_parallel_linear_cross_entropy: weight {tuple(weight.shape)} must be [local_vocab, "
            f"{hidden.shape[-1]}]"
        )
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: chunk_size={chunk_size} must be positive")
    shard = resolve_vocab_shard(weight.shape[0], vocab_start_index, vocab_end_index, tp_group, hidden.device)
    shape = target.shape
    target = target.reshape(-1).to(dtype=torch.long)
    check_ids_in_vocab(target, ignore_index, shard.vocab_size, "target", sp_group)
    hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    weight = weight.contiguous()
    if chunk_size is None:
        comm = group_collectives(tp_group)
        tp = 1 if comm is None else comm.world_size
        chunk_size = default_chunk_rows(hidden.shape[0], shard.vocab_size, tp, hidden.shape[1])
    device_type = hidden.device.type
    compute_dtype = _autocast_dtype(device_type) or torch.promote_types(hidden.dtype, weight.dtype)
    with torch.autocast(device_type, enabled=False):
        per_token = _LinearCrossEntropy.apply(
            hidden,
            weight,
            bias,
            target,
            tp_group,
            shard.start,
            shard.end,
            ignore_index,
            chunk_size,
            compute_dtype,
        )
    if reduction == "none":
        return per_token.view(shape)
    loss = per_token.sum()
    if reduction == "mean":
        valid = (target != ignore_index).sum().to(torch.float32)
        sp = group_collectives(sp_group)
        if sp is not None:
            sp.all_reduce(valid, label="sequence-parallel valid tokens")
        loss = loss / valid.clamp(min=1.0)
    return _sequence_sum(loss, sp_group)
