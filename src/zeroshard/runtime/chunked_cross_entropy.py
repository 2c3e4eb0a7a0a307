"""`deepspeed.runtime.chunked_cross_entropy`: a causal LM's cross entropy without full-vocabulary fp32 tensors.

[Note: chunked cross entropy]
Hugging Face's `ForCausalLMLoss` casts the [tokens, vocab] logits to fp32 and calls `cross_entropy`, which keeps an
fp32 log-softmax for backward, and backward makes two more fp32 [tokens, vocab] tensors: at 8k tokens and a
152k vocabulary each is 5 GB, all alive at the start of backward, where training memory peaks. Here forward keeps
only the logits it was given and one fp32 log-sum-exp per token; rows are processed in blocks of about 2^26 fp32
elements (256 MiB of temporaries whatever the vocabulary), and backward recomputes each block's softmax and writes
the gradient straight into a tensor of the logits' dtype (what the eager path casts its fp32 gradient to anyway).
The loss and the gradient are DeepSpeed 0.19.8's PyTorch backend's to the bit
(`tests/unit/test_chunked_cross_entropy.py`).
DeepSpeed also has a Triton kernel, which "auto" picks on CUDA; zeroshard has none: "auto" is the blockwise PyTorch
path on every device, and "triton" is refused in one line.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "triton", "torch")
_BLOCK_ELEMENTS = 1 << 26  # fp32 elements of one block's temporaries


def triton_backend_available() -> bool:
    """Whether the Triton kernel can run: never here ([Note: chunked cross entropy])."""
    return False


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"chunked cross entropy: backend {backend!r} is unknown; choose from {BACKENDS}")
    if backend == "triton":
        raise RuntimeError(
            'chunked cross entropy: zeroshard has no Triton kernel; use backend="torch" or "auto" (the blockwise '
            "PyTorch path, on any device)"
        )


def _checked_block_rows(block_rows: int | None) -> int | None:
    if block_rows is None:
        return None
    try:
        rows = operator.index(block_rows)
    except TypeError as error:
        raise TypeError(
            f"chunked cross entropy: block_rows must be a positive integer or None, got {block_rows!r}"
        ) from error
    if rows <= 0:
        raise ValueError(f"chunked cross entropy: block_rows must be a positive integer or None, got {rows}")
    return rows


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Per-row losses over [rows, vocab] logits, block by block; ignored rows give 0 loss and 0 gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, rows: int) -> torch.Tensor:
        valid = target != ignore_index
        index = torch.where(valid, target, torch.zeros_like(target))  # an ignored row gathers column 0, then drops it
        count = logits.shape[0]
        lse = torch.empty(count, dtype=torch.float32, device=logits.device)
        picked = torch.empty(count, dtype=torch.float32, device=logits.device)
        for start in range(0, count, rows):
            block = logits[start : start + rows].float()
            lse[start : start + rows] = torch.logsumexp(block, dim=-1)
            picked[start : start + rows] = block.gather(-1, index[start : start + rows, None]).squeeze(-1)
        ctx.save_for_backward(logits, index, valid, lse)
        ctx.rows = rows
        return torch.where(valid, lse - picked, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if torch.is_grad_enabled():  # the gradient is made outside autograd: a second derivative would be missing
            raise RuntimeError("chunked cross entropy has no second derivative; backward(create_graph=True) is refused")
        logits, index, valid, lse = ctx.saved_tensors
        scale = torch.where(valid, grad.float(), torch.zeros_like(lse))
        out = torch.empty_like(logits)
        rows = ctx.rows
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            # d loss_i / d logit_ij = softmax_ij - [j == target_i], times row i's incoming gradient
            block = torch.exp(logits[start:stop].float() - lse[start:stop, None])
            block.scatter_add_(-1, index[start:stop, None], -torch.ones_like(block[:, :1]))
            block.mul_(scale[start:stop, None])
            out[start:stop] = block.to(out.dtype)
        return out, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    block_rows: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)` without fp32 [rows, vocab] tensors
    ([Note: chunked cross entropy]). `logits` [rows, vocab], `target` [rows] of torch.long; "mean" divides by the
    rows not ignored (NaN when all are, as `cross_entropy`); `block_rows` sets the rows per block.

    Example:
        >>> logits, target = torch.randn(6, 11), torch.tensor([1, 2, -100, 4, 5, 6])
        >>> torch.allclose(chunked_cross_entropy(logits, target), F.cross_entropy(logits, target))
        True
    """
    rows = _checked_block_rows(block_rows)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"chunked cross entropy: expected [rows, vocab] logits and [rows] targets, got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}"
        )
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"chunked cross entropy: reduction {reduction!r} is unknown; choose none, sum or mean")
    if target.dtype != torch.long:
        raise RuntimeError(f"chunked cross entropy: targets must be torch.long class indices, got {target.dtype}")
    _check_backend(backend)
    target = target.to(device=logits.device).contiguous()
    logits = logits.contiguous()
    vocab = logits.shape[-1]
    outside = (target != ignore_index) & ((target < 0) | (target >= vocab))
    # checked on the device, as cross_entropy fails, without a host synchronisation every step
    torch._assert_async(~outside.any(), f"chunked cross entropy: a target is outside the vocabulary of {vocab}")
    loss = _BlockwiseCrossEntropy.apply(logits, target, ignore_index, rows or max(1, _BLOCK_ELEMENTS // vocab))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


class ChunkedCausalLMLoss:
    """Hugging Face's `ForCausalLMLoss` (the labels shifted by one, `ignore_index` rows left out, the sum divided by
    `num_items_in_batch` when given, else the mean) over `chunked_cross_entropy`."""

    def __init__(self, block_rows: int | None = None, backend: str = "auto") -> None:
        _check_backend(backend)
        self.block_rows = _checked_block_rows(block_rows)
        self.backend = backend

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            assert labels is not None, "ChunkedCausalLMLoss: labels or shift_labels"
            # position t predicts token t + 1; the last position predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        summed = num_items_in_batch is not None
        loss = chunked_cross_entropy(
            logits.reshape(-1, vocab_size),
            shift_labels.reshape(-1),
            ignore_index=ignore_index,
            reduction="sum" if summed else "mean",
            block_rows=self.block_rows,
            backend=self.backend,
        )
        if summed:
            if isinstance(num_items_in_batch, torch.Tensor):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def install_chunked_causal_lm_loss(
    model: Any, block_rows: int | None = None, backend: str = "auto"
) -> ChunkedCausalLMLoss:
    """Make a Hugging Face causal LM's training loss a `ChunkedCausalLMLoss`. Only the stock `ForCausalLMLoss` is
    replaced (the same objective); a model with another loss function is refused in one line.

    Example:
        >>> loss = install_chunked_causal_lm_loss(model)  # doctest: +SKIP
    """
    from transformers.loss.loss_utils import ForCausalLMLoss

    current = getattr(model, "loss_function", None)
    if current is not ForCausalLMLoss:
        raise ValueError(
            "install_chunked_causal_lm_loss replaces only Hugging Face's stock ForCausalLMLoss; this model's "
            f"loss_function is {current!r}"
        )
    loss = ChunkedCausalLMLoss(block_rows=block_rows, backend=backend)
    try:
        model.loss_function = loss
    except (AttributeError, TypeError) as error:
        raise ValueError("install_chunked_causal_lm_loss: the model's loss_function cannot be set") from error
    if model.loss_function is not loss:
        raise ValueError("install_chunked_causal_lm_loss: the model's loss_function cannot be set")
    return loss


__all__ = [
    "BACKENDS",
    "ChunkedCausalLMLoss",
    "chunked_cross_entropy",
    "install_chunked_causal_lm_loss",
    "triton_backend_available",
]
