"""`zeroshard.runtime.zero.tiling` without a process group: TiledLinear and TiledLinearReturnBias give DeepSpeed
0.19.8's outputs and input and weight gradients bit for bit, with the same weights, over a grid of even and uneven
splits, with and without bias, a pre-split input and uncombined outputs; they equal a plain nn.Linear to rounding;
DeepSpeed's own tile-layout test holds; bad arguments are one-line errors."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias, TilingError, split_tensor_along_last_dim

SHAPES = [(8, 12), (11, 13), (13, 7)]  # (in_features, out_features): even and uneven cuts
OURS: dict[str, type[TiledLinear]] = {"TiledLinear": TiledLinear, "TiledLinearReturnBias": TiledLinearReturnBias}
SPLITS = list(itertools.product(range(1, 5), range(1, 5)))  # (in_splits, out_splits)


class ReturnsBias(nn.Linear):
    """A tile returning its bias instead of adding it (Megatron-LM's linears, DeepSpeed's test's LinearWrapper)."""

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(input, self.weight), self.bias


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    """Every tensor of a forward's result (a tensor, a list of row results, a (tensor, bias) pair or lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if out is None:
        return []
    return [t for item in out for t in _flat_outputs(item)]


def _run(layer: nn.Module, x: torch.Tensor, pre_split: bool) -> list[torch.Tensor]:
    """The outputs, then the gradients of the input and of every parameter, of sum(out * weights) over the outputs."""
    x = x.clone().requires_grad_()
    inputs: Any = split_tensor_along_last_dim(x, _widths(layer.in_parts)) if pre_split else x
    outs = _flat_outputs(layer(inputs))
    loss = sum((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() for out in outs)
    params = list(layer.parameters())
    grads = torch.autograd.grad(loss, [x, *params])
    return [o.detach() for o in outs] + list(grads)


def _widths(parts: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(parts)]


def _pair(
    ds: Any, cls_name: str, shape: tuple[int, int], splits: tuple[int, int], **kwargs: Any
) -> tuple[nn.Module, nn.Module, nn.Linear]:
    in_f, out_f = shape
    torch.manual_seed(in_f * 100 + out_f)
    linear_cls = kwargs.get("linear_cls", nn.Linear)
    base = linear_cls(in_f, out_f, bias=kwargs.get("bias", True))
    ours = OURS[cls_name](in_f, out_f, in_splits=splits[0], out_splits=splits[1], **kwargs)
    theirs = getattr(ds, cls_name)(in_f, out_f, in_splits=splits[0], out_splits=splits[1], **kwargs)
    ours.copy_params_from(base)
    theirs.copy_params_from(copy.deepcopy(base))
    return ours, theirs, base


CASES = [
    pytest.param(cls_name, kwargs, id=f"{cls_name}-{label}")
    for cls_name in ("TiledLinear", "TiledLinearReturnBias")
    for label, kwargs in [
        ("bias", {}),
        ("nobias", {"bias": False}),
        ("presplit", {"input_is_already_split": True}),
        ("rows", {"combine_out_splits": False}),
        ("presplit-rows-nobias", {"input_is_already_split": True, "combine_out_splits": False, "bias": False}),
    ]
]


@pytest.mark.parametrize("cls_name,kwargs", CASES)
def test_outputs_and_gradients_equal_deepspeed_bit_for_bit(cls_name: str, kwargs: dict[str, Any]) -> None:
    ds = import_deepspeed("deepspeed.runtime.zero.tiling")
    if cls_name == "TiledLinearReturnBias":
        kwargs = {**kwargs, "linear_cls": ReturnsBias}
    for shape, splits in itertools.product(SHAPES, SPLITS):
        ours, theirs, _ = _pair(ds, cls_name, shape, splits, **kwargs)
        assert (ours.in_parts, ours.out_parts) == (theirs.in_parts, theirs.out_parts), (shape, splits)
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), (shape, splits)
        x = torch.randn(3, 2, shape[0], generator=torch.Generator().manual_seed(5))
        pre_split = kwargs.get("input_is_already_split", False) and splits[0] > 1
        got, want = _run(ours, x, pre_split), _run(theirs, x, pre_split)
        assert len(got) == len(want), (shape, splits)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape and torch.equal(g, w), (shape, splits, i)


@pytest.mark.parametrize("bias", [True, False])
def test_equal_to_the_linear_it_copies(bias: bool) -> None:
    for shape, splits in itertools.product(SHAPES, SPLITS):
        torch.manual_seed(0)
        base = nn.Linear(*shape, bias=bias)
        tiled = TiledLinear(*shape, bias=bias, in_splits=splits[0], out_splits=splits[1], init_linear=base)
        x = torch.randn(4, shape[0])
        got, want = _run(tiled, x, False), _run(base, x, False)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)  # the input's gradient
        weight_grad, bias_grad = want[2], want[3] if bias else None
        tiles = iter(got[2:])
        for o, i in itertools.product(range(splits[1]), range(splits[0])):
            rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            torch.testing.assert_close(next(tiles), weight_grad[rows, cols], rtol=1e-6, atol=1e-6)
            if bias_grad is not None and i == splits[0] - 1:
                torch.testing.assert_close(next(tiles), bias_grad[rows], rtol=1e-6, atol=1e-6)
        assert next(tiles, None) is None


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (2, 2), (5, 5), (32, 32)])
def test_tiles_hold_the_copied_slices(in_splits: int, out_splits: int) -> None:
    """DeepSpeed's `test_tiled_init`: tile (o, i) holds the (o, i) block of the copied weight; the row's last tile the
    bias."""
    base = nn.Linear(32, 40, bias=True)
    tiled = TiledLinear(32, 40, bias=True, init_linear=copy.deepcopy(base), out_splits=out_splits, in_splits=in_splits)
    for o, i in itertools.product(range(out_splits), range(in_splits)):
        tile = tiled.linears[o][i]
        rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
        assert isinstance(tile, nn.Linear) and torch.equal(tile.weight, base.weight[rows, cols])
        if i == in_splits - 1:
            assert torch.equal(tile.bias, base.bias[rows])
        else:
            assert tile.bias is None


def test_return_bias_without_bias_returns_none() -> None:
    tiled = TiledLinearReturnBias(6, 5, bias=False, in_splits=2, out_splits=2, linear_cls=ReturnsBias)
    out, bias = tiled(torch.randn(2, 6))
    assert out.shape == (2, 5) and bias is None


def _message(fn: Any) -> str:
    with pytest.raises(TilingError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    return message


def test_bad_arguments_are_one_line_errors() -> None:
    assert "in_splits=0" in _message(lambda: TiledLinear(32, 32, in_splits=0))
    assert "in_splits=33" in _message(lambda: TiledLinear(32, 32, in_splits=33))
    assert "out_splits=0" in _message(lambda: TiledLinear(32, 32, out_splits=0))
    assert "out_splits=9" in _message(lambda: TiledLinear(32, 8, out_splits=9))
    presplit = TiledLinear(6, 4, in_splits=3, input_is_already_split=True)
    assert "3 inputs" in _message(lambda: presplit(list(torch.randn(2, 6).split(3, dim=-1))))
    tiled = TiledLinear(6, 4, in_splits=2)
    assert "(4, 6)" in _message(lambda: tiled.copy_params_from(nn.Linear(4, 6)))
    assert "has none" in _message(lambda: tiled.copy_params_from(nn.Linear(6, 4, bias=False)))
    assert "bias=False" in _message(lambda: TiledLinear(6, 4, bias=False).copy_params_from(nn.Linear(6, 4)))
    assert "no weight" in _message(lambda: tiled.copy_params_from(nn.ReLU()))
    plain_tiles = TiledLinearReturnBias(6, 4, in_splits=2)
    assert "(tensor, bias) pair" in _message(lambda: plain_tiles(torch.randn(2, 6)))


def test_split_tensor_along_last_dim() -> None:
    x = torch.arange(14.0).view(2, 7)
    chunks = split_tensor_along_last_dim(x, [4, 3])
    assert [c.shape for c in chunks] == [(2, 4), (2, 3)] and not chunks[0].is_contiguous()
    assert all(c.is_contiguous() for c in split_tensor_along_last_dim(x, [4, 3], contiguous_split_chunks=True))
    assert torch.equal(torch.cat(chunks, dim=-1), x)
