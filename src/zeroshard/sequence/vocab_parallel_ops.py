"""`deepspeed.sequence.vocab_parallel_ops`: log-probabilities, entropy and KL over vocabulary-sharded logits.

[Note: per-token statistics over vocabulary shards]
RL and on-policy distillation losses read per-token quantities of the softmax (the sampled tokens' log-probabilities,
the entropy, a KL to a teacher) from the logits of a vocabulary-parallel LM head. As in [Note: vocabulary-parallel
cross entropy], each needs a few numbers per token from across the tensor-parallel group: the global max and the
sum of shifted exponentials (two all-reduces shared by every tensor an op reads), then one SUM all-reduce of the
op's per-token partial sums. The results are fp32, the same on every rank, so masking and reduction are the
caller's; backward assumes every rank back-propagates the same loss and needs no communication. The max and the
log-sum are kept apart (folding them into one log-sum-exp rounds a small normaliser away under a large offset).
Elementwise work runs over row blocks of at most 2^24 logits, so fp32 temporaries stay bounded however many tokens
there are. A row whose logits are all -inf has no distribution: entropy and KL give NaN there and its logits get
zero gradient, so padding rows can be masked out. Values and gradients equal DeepSpeed 0.19.8's to the bit
(`tests/distributed/test_vocab_parallel_ce.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from zeroshard.sequence.vocab_shard import VocabShard, check_ids_in_vocab, group_collectives, resolve_vocab_shard

_BLOCK_NUMEL = 1 << 24
_NEG_INF = float("-inf")


def _row_blocks(logits: torch.Tensor) -> Iterator[slice]:
    rows = max(1, _BLOCK_NUMEL // max(1, logits.shape[-1]))
    for start in range(0, logits.shape[0], rows):
        yield slice(start, start + rows)


def _softmax_stats(tensors: list[torch.Tensor], tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Global fp32 (max, log of the sum of shifted exponentials) per row of each `[rows, local_vocab]` tensor,
    each `[len(tensors), rows]`; all tensors share one MAX and one SUM all-reduce. An empty shard still joins both
    (contributing -inf and 0)."""
    comm = group_collectives(tp_group)
    device = tensors[0].device
    global_max = torch.empty(len(tensors), tensors[0].shape[0], dtype=torch.float32, device=device)
    for i, logits in enumerate(tensors):
        if logits.shape[-1] == 0:
            global_max[i].fill_(_NEG_INF)
            continue
        for rows in _row_blocks(logits):
            global_max[i, rows] = logits[rows].amax(dim=-1).float()
    if comm is not None:
        comm.all_reduce(global_max, op="max", label="vocab-parallel softmax max")
    sum_exp = torch.empty_like(global_max)
    for i, logits in enumerate(tensors):
        for rows in _row_blocks(logits):
            sum_exp[i, rows] = torch.exp(logits[rows].float() - global_max[i, rows].unsqueeze(-1)).sum(dim=-1)
    if comm is not None:
        comm.all_reduce(sum_exp, label="vocab-parallel softmax sum")
    return global_max, torch.log(sum_exp)


def _log_softmax(logits: torch.Tensor, global_max: torch.Tensor, log_sum_exp: torch.Tensor) -> torch.Tensor:
    return torch.sub(logits.float(), global_max.unsqueeze(-1)).sub_(log_sum_exp.unsqueeze(-1))


def _weighted_by_probs(
    log_probs: torch.Tensor, values: torch.Tensor, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """p * values, 0 where log p is -inf (even where `values` is infinite: 0 * inf would make the row NaN)."""
    if probs is None:
        probs = torch.exp(log_probs)
    return (probs * values).masked_fill_(log_probs == _NEG_INF, 0.0)


def _kl_terms(a_log_probs: torch.Tensor, b_log_probs: torch.Tensor) -> torch.Tensor:
    """KL(A || B)'s terms; +inf where B masks a token A gives support (even if p_A underflowed to 0)."""
    terms = _weighted_by_probs(a_log_probs, a_log_probs - b_log_probs)
    return terms.masked_fill_((b_log_probs == _NEG_INF) & (a_log_probs != _NEG_INF), float("inf"))


def _undefined_rows(global_max: torch.Tensor) -> torch.Tensor:
    return (global_max == _NEG_INF).unsqueeze(-1)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """`[rows, local_vocab]`, the row count given explicitly (reshape(-1, 0) is ambiguous for an empty shard)."""
    return logits.reshape(logits.shape[:-1].numel(), logits.shape[-1])


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, sharded: torch.Tensor, index: torch.Tensor, tp_group: Any, start: int, ignore_index: int
    ) -> torch.Tensor:
        comm = group_collectives(tp_group)
        logits = _rows(sharded)
        index = index.reshape(logits.shape[0], index.shape[-1])
        local_vocab = logits.shape[-1]
        global_max, log_sum_exp = (stat[0] for stat in _softmax_stats([logits], tp_group))
        valid = index != ignore_index
        local_index = index - start
        held = valid & (local_index >= 0) & (local_index < local_vocab)
        local_index = local_index.clamp(min=0, max=local_vocab - 1)
        shifted = logits.gather(-1, local_index).float() - global_max.unsqueeze(-1)
        shifted = torch.where(held, shifted, torch.zeros_like(shifted))
        if comm is not None:
            comm.all_reduce(shifted, label="vocab-parallel log-probabilities")
        logprobs = shifted - log_sum_exp.unsqueeze(-1)
        logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
        ctx.save_for_backward(sharded, global_max, log_sum_exp, local_index, held, valid)
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        sharded, global_max, log_sum_exp, local_index, held, valid = ctx.saved_tensors
        logits = _rows(sharded)
        grad_output = grad_output.reshape(valid.shape).float() * valid
        index_grad = grad_output * held
        grad_sum = grad_output.sum(dim=-1, keepdim=True)
        # a row of ignored ids has a constant output: gradient exactly 0 (its softmax times 0 may be NaN)
        zero_rows = ~valid.any(dim=-1, keepdim=True) | _undefined_rows(global_max)
        grad = torch.empty_like(logits)  # d logp(i) / d z_j = onehot(i)_j - softmax(z)_j, summed over the ids
        for rows in _row_blocks(logits):
            block = torch.exp(_log_softmax(logits[rows], global_max[rows], log_sum_exp[rows])) * -grad_sum[rows]
            block.masked_fill_(zero_rows[rows], 0.0)
            block.scatter_add_(-1, local_index[rows], index_grad[rows])
            grad[rows] = block
        return grad.view_as(sharded), None, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, sharded: torch.Tensor, tp_group: Any) -> torch.Tensor:  # type: ignore[override]
        comm = group_collectives(tp_group)
        logits = _rows(sharded)
        global_max, log_sum_exp = (stat[0] for stat in _softmax_stats([logits], tp_group))
        entropy = torch.empty_like(global_max)
        for rows in _row_blocks(logits):
            log_probs = _log_softmax(logits[rows], global_max[rows], log_sum_exp[rows])
            entropy[rows] = -_weighted_by_probs(log_probs, log_probs).sum(dim=-1)
        if comm is not None:
            comm.all_reduce(entropy, label="vocab-parallel entropy")
        ctx.save_for_backward(sharded, global_max, log_sum_exp, entropy)
        return entropy.clone()  # callers may mask it in place; the saved one must stay

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        sharded, global_max, log_sum_exp, entropy = ctx.saved_tensors
        logits = _rows(sharded)
        grad_output = grad_output.reshape(-1, 1).float()
        undefined = _undefined_rows(global_max)
        grad = torch.empty_like(logits)  # dH / dz_j = -p_j (log p_j + H)
        for rows in _row_blocks(logits):
            log_probs = _log_softmax(logits[rows], global_max[rows], log_sum_exp[rows])
            block = _weighted_by_probs(log_probs, log_probs + entropy[rows].unsqueeze(-1))
            grad[rows] = block.mul_(-grad_output[rows]).masked_fill_(undefined[rows], 0.0)
        return grad.view_as(sharded), None


def _kl_order(student: Any, teacher: Any, reverse: bool) -> tuple[Any, Any]:
    """(A, B) of KL(A || B): the teacher weights the log-ratio for forward KL, the student for reverse KL."""
    return (student, teacher) if reverse else (teacher, student)


class _KLDiv(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, student_logits: torch.Tensor, teacher_logits: torch.Tensor, reverse: bool, tp_group: Any
    ) -> torch.Tensor:
        comm = group_collectives(tp_group)
        student, teacher = _rows(student_logits), _rows(teacher_logits)
        global_max, log_sum_exp = _softmax_stats([student, teacher], tp_group)
        kl = torch.empty_like(global_max[0])
        for rows in _row_blocks(student):
            s_log_probs = _log_softmax(student[rows], global_max[0, rows], log_sum_exp[0, rows])
            t_log_probs = _log_softmax(teacher[rows], global_max[1, rows], log_sum_exp[1, rows])
            kl[rows] = _kl_terms(*_kl_order(s_log_probs, t_log_probs, reverse)).sum(dim=-1)
        if comm is not None:
            comm.all_reduce(kl, label="vocab-parallel KL")
        ctx.reverse = reverse
        ctx.save_for_backward(student_logits, teacher_logits, global_max, log_sum_exp, kl)
        return kl.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        student_logits, teacher_logits, global_max, log_sum_exp, kl = ctx.saved_tensors
        student, teacher = _rows(student_logits), _rows(teacher_logits)
        grad_output = grad_output.reshape(-1, 1).float()
        grad_student = torch.empty_like(student) if ctx.needs_input_grad[0] else None
        grad_teacher = torch.empty_like(teacher) if ctx.needs_input_grad[1] else None
        a_grad, b_grad = _kl_order(grad_student, grad_teacher, ctx.reverse)
        undefined = _undefined_rows(global_max).any(dim=0)  # either distribution undefined: zero gradient
        for rows in _row_blocks(student):
            s_log_probs = _log_softmax(student[rows], global_max[0, rows], log_sum_exp[0, rows])
            t_log_probs = _log_softmax(teacher[rows], global_max[1, rows], log_sum_exp[1, rows])
            a_log_probs, b_log_probs = _kl_order(s_log_probs, t_log_probs, ctx.reverse)
            a_probs = torch.exp(a_log_probs)
            # KL(A || B): dKL/dz_A = p_A (log p_A - log p_B - KL), dKL/dz_B = p_B - p_A
            if a_grad is not None:
                log_ratio = a_log_probs - b_log_probs - kl[rows].unsqueeze(-1)
                block = _weighted_by_probs(a_log_probs, log_ratio, a_probs).mul_(grad_output[rows])
                a_grad[rows] = block.masked_fill_(undefined[rows], 0.0)
            if b_grad is not None:
                block = (torch.exp(b_log_probs) - a_probs).mul_(grad_output[rows])
                b_grad[rows] = block.masked_fill_(undefined[rows], 0.0)
        return (
            None if grad_student is None else grad_student.view_as(student_logits),
            None if grad_teacher is None else grad_teacher.view_as(teacher_logits),
            None,
            None,
        )


def vocab_parallel_logprobs(
    vocab_parallel_logits: torch.Tensor,
    index: torch.Tensor,
    tp_group: Any = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    global_vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """fp32 log-probabilities of the token ids `index` (the logits' other dimensions, optionally with a trailing
    top-k dimension; the same on every tensor-parallel rank) under vocabulary-sharded logits; `ignore_index` gives
    0. The result has `index`'s shape.

    >>> import torch
    >>> logits, ids = torch.randn(3, 8), torch.tensor([0, 5, 7])
    >>> lp = vocab_parallel_logprobs(logits, ids)
    >>> torch.allclose(lp, logits.log_softmax(-1).gather(-1, ids[:, None])[:, 0])
    True
    """
    single = index.shape == vocab_parallel_logits.shape[:-1]
    if not single and index.shape[:-1] != vocab_parallel_logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_logprobs: index {tuple(index.shape)} must be the logits' "
            f"{tuple(vocab_parallel_logits.shape[:-1])}, optionally followed by a top-k dimension"
        )
    if global_vocab_size is None:
        shard = resolve_vocab_shard(
            vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, tp_group, vocab_parallel_logits.device
        )
    elif vocab_start_index is None or vocab_end_index is None:
        raise ValueError("global_vocab_size needs explicit vocab_start_index and vocab_end_index")
    else:
        shard = VocabShard(vocab_start_index, vocab_end_index, global_vocab_size)
    index = index.to(dtype=torch.long)
    check_ids_in_vocab(index, ignore_index, shard.vocab_size, "index")
    if single:
        index = index.unsqueeze(-1)
    logprobs = _LogProbs.apply(vocab_parallel_logits, index, tp_group, shard.start, ignore_index)
    return logprobs.view(index.shape).squeeze(-1) if single else logprobs.view(index.shape)


def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """fp32 per-token entropy of the softmax over vocabulary-sharded logits."""
    return _Entropy.apply(vocab_parallel_logits, tp_group).view(vocab_parallel_logits.shape[:-1])


def vocab_parallel_kl_div(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, reverse: bool = False, tp_group: Any = None
) -> torch.Tensor:
    """fp32 per-token KL(teacher || student), or KL(student || teacher) with `reverse` (on-policy distillation's
    usual objective), between identically sharded logits (apply any temperature first; detach the teacher's to keep
    its gradient out)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"vocab_parallel_kl_div: student {tuple(student_logits.shape)} and teacher "
            f"{tuple(teacher_logits.shape)} logits must have one shape and one vocabulary sharding"
        )
    kl = _KLDiv.apply(student_logits, teacher_logits, bool(reverse), tp_group)
    return kl.view(student_logits.shape[:-1])
