"""`deepspeed.runtime.chunked_cross_entropy` ([Note: chunked cross entropy]): loss and gradient equal DeepSpeed
0.19.8's PyTorch backend to the bit (fp32 and bf16 logits, ignored rows, every reduction, blocks of several sizes),
`cross_entropy`'s to rounding; backward keeps no fp32 [rows, vocab] tensor; the causal-LM loss installed on a
transformers model trains as its stock loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.runtime.chunked_cross_entropy import (
    ChunkedCausalLMLoss,
    chunked_cross_entropy,
    install_chunked_causal_lm_loss,
    triton_backend_available,
)


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(13, 37, generator=g) * 3).to(dtype)
    target = torch.randint(0, 37, (13,), generator=g)
    target[[2, 7]] = -100
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("block_rows", [None, 1, 4])
def test_loss_and_gradient_are_deepspeeds_bit_for_bit(dtype: torch.dtype, reduction: str, block_rows: Any) -> None:
    ds = import_deepspeed("deepspeed.runtime.chunked_cross_entropy")
    logits, target = _inputs(dtype)
    results = []
    for fn in (chunked_cross_entropy, ds.chunked_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = fn(x, target, reduction=reduction, block_rows=block_rows, backend="torch")
        weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
        (loss * weights).sum().backward()
        results.append((loss.detach(), x.grad))
    (loss, grad), (ds_loss, ds_grad) = results
    assert loss.dtype == ds_loss.dtype and torch.equal(loss, ds_loss)
    assert grad.dtype == dtype and torch.equal(grad, ds_grad)
    reference = logits.float().requires_grad_()
    expected = F.cross_entropy(reference, target, reduction=reduction)
    (expected * torch.linspace(0.5, 1.5, expected.numel()).reshape(expected.shape)).sum().backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert reference.grad is not None
    torch.testing.assert_close(grad.float(), reference.grad.to(dtype).float(), rtol=1e-2, atol=1e-6)


def test_backward_keeps_the_logits_and_one_value_per_row() -> None:
    logits, target = _inputs(torch.bfloat16)
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    x = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(x, target)
    assert (torch.float32, (13, 37)) not in saved and (torch.bfloat16, (13, 37)) in saved
    assert all(shape in ((13, 37), (13,)) or dtype is not torch.float32 for dtype, shape in saved), saved
    loss.backward()
    with pytest.raises(RuntimeError, match="no second derivative"):
        y = logits.float().clone().requires_grad_()
        torch.autograd.grad(chunked_cross_entropy(y, target), y, create_graph=True)


def test_refusals_are_one_line() -> None:
    logits, target = _inputs(torch.float32)
    assert not triton_backend_available()
    with pytest.raises(RuntimeError, match='no Triton kernel; use backend="torch"'):
        chunked_cross_entropy(logits, target, backend="triton")
    with pytest.raises(ValueError, match="backend 'cuda' is unknown"):
        ChunkedCausalLMLoss(backend="cuda")
    with pytest.raises(ValueError, match="block_rows must be a positive integer or None, got 0"):
        chunked_cross_entropy(logits, target, block_rows=0)
    with pytest.raises(RuntimeError, match="must be torch.long"):
        chunked_cross_entropy(logits, target.int())
    with pytest.raises(ValueError, match=r"expected \[rows, vocab\] logits"):
        chunked_cross_entropy(logits[None], target)


def test_installed_on_a_causal_lm_it_trains_as_the_stock_loss() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    def model() -> LlamaForCausalLM:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        return LlamaForCausalLM(config)

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    stock, chunked = model(), model()
    installed = install_chunked_causal_lm_loss(chunked, block_rows=5)
    assert chunked.loss_function is installed
    for m in (stock, chunked):
        m(input_ids=ids, labels=labels).loss.backward()
    expected = stock(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(chunked(input_ids=ids, labels=labels).loss, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(stock.parameters(), chunked.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="replaces only Hugging Face's stock ForCausalLMLoss"):
        install_chunked_causal_lm_loss(chunked)  # its loss is the chunked one now
