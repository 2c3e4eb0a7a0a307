"""`deepspeed.runtime.zero.tiling`: `TiledLinear`, a linear layer cut into `out_splits x in_splits` smaller linear
modules (tiles), `TiledLinearReturnBias` for tiles that return their bias (Megatron-LM's linears), and
`split_tensor_along_last_dim`.

Why tiles: under ZeRO-3 a huge linear layer's weight is gathered whole for its forward and backward; cut into tiles,
each a module of its own, only the tiles in use need to be gathered. Tile (o, i) maps the i-th slice of the input
features to the o-th slice of the output features; slices follow `partition_uniform` (the first `features % splits`
slices take one more feature). Output slice o is the sum of its tiles over i, in increasing i (the first partial
result copied, the others added to it), which is DeepSpeed 0.19.8's order, so outputs and gradients equal its to the
bit. Only the last tile of a row (i = in_splits - 1) has a bias, so it is added once.

[Note: tiles under zeroshard's stage 3]
zeroshard gathers parameters by unit, in the pre-forward hook of the unit's module ([Note: units] in
zero/stage3/plan.py), not module by module as DeepSpeed. Its default policy makes the repeated composite children of
a ModuleList units, if they have a forward of their own: a plain ModuleList row is never called (DeepSpeed calls the
tiles directly), so that policy looks into it and its tiles would join the parent's unit, gathered whole. Each row
here is therefore a `TileRow`, a ModuleList whose forward runs its tiles: for a TiledLinear outside every block with
`out_splits >= 2` the rows are units, and a row is gathered for its forward and backward, one row at a time. With
`out_splits == 1` the tiles belong to the root unit, and inside a block to the block's unit (gathered whole with
it). A tile is gathered alone only under a unit policy that makes each tile a unit, which `initialize` does not
offer. The results are the same in every case: only the gathered working set differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.runtime.utils import partition_uniform
from zeroshard.zero.stage3.gathered import GatheredParameters


class TilingError(ZeroshardError, ValueError):
    """A TiledLinear argument or input that cannot be tiled (a RuntimeError too, as DeepSpeed's split checks raise)."""


def split_tensor_along_last_dim(
    tensor: torch.Tensor, partitions: int | list[int], contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """`torch.split` along the last dimension (`partitions`: the size of each chunk, or one size for all); with
    `contiguous_split_chunks` each chunk is copied to contiguous memory (the split's chunks are views).

    Example:
        >>> [c.shape[-1] for c in split_tensor_along_last_dim(torch.zeros(2, 7), [4, 3])]
        [4, 3]
    """
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return tuple(chunks)


def _check_splits(name: str, splits: int, features_name: str, features: int) -> None:
    if splits < 1 or splits > features:
        raise TilingError(
            f"TiledLinear: {name}={splits} must be in 1..{features_name} ({features}); choose fewer tiles"
        )


def _tile_param(tile: nn.Module, name: str) -> nn.Parameter:
    param = getattr(tile, name, None)
    if not isinstance(param, nn.Parameter):
        raise TilingError(f"TiledLinear.copy_params_from: the tile ({type(tile).__name__}) has no {name} parameter")
    return param


class TileRow(nn.ModuleList):
    """The tiles of one output slice, called as one module ([Note: tiles under zeroshard's stage 3]): `forward`
    folds the tiles' results over the input slices with `reduce(in_id, result so far or None, tile's result)`."""

    def forward(self, inputs: Sequence[Any], reduce: Callable[[int, Any, Any], Any]) -> Any:
        out = None
        for in_id, tile in enumerate(self):
            out = reduce(in_id, out, tile(inputs[in_id]))
        return out


class TiledLinear(nn.Module):
    """A drop-in `torch.nn.Linear` made of `out_splits x in_splits` tiles, `linears[o][i]` (see the module docstring).

    `input_is_already_split`: `forward` takes a sequence of `in_splits` inputs, one per input slice (with
    `in_splits == 1`, a single tensor). `combine_out_splits=False`: `forward` returns the list of `out_splits` output
    slices instead of their concatenation. `linear_cls(in_dim, out_dim, bias=..., **kwargs)` builds each tile.
    `init_linear`: a linear layer whose weight and bias the tiles copy (`copy_params_from`).

    Example:
        >>> base = torch.nn.Linear(10, 7)
        >>> tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, init_linear=base)
        >>> x = torch.randn(4, 10)
        >>> torch.allclose(tiled(x), base(x), atol=1e-6)
        True
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type[nn.Module] = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, "in_features", in_features)
        _check_splits("out_splits", out_splits, "out_features", out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        # slice p of the features is [parts[p], parts[p + 1])
        self.in_parts = partition_uniform(num_items=in_features, num_parts=in_splits)
        self.out_parts = partition_uniform(num_items=out_features, num_parts=out_splits)

        self.linears = nn.ModuleList()
        for out_id in range(out_splits):
            row = TileRow()
            out_dim = self.out_parts[out_id + 1] - self.out_parts[out_id]
            for in_id in range(in_splits):
                in_dim = self.in_parts[in_id + 1] - self.in_parts[in_id]
                tile_bias = bias and in_id == in_splits - 1  # the row's sum gets its bias once
                row.append(linear_cls(in_dim, out_dim, bias=tile_bias, **kwargs))
            self.linears.append(row)

        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits > 1 and not self.input_is_already_split:
            parts = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [parts[p + 1] - parts[p] for p in range(self.in_splits)])
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise TilingError(
                    f"TiledLinear: input_is_already_split needs {self.in_splits} inputs (in_splits), got {len(inputs)}"
                )
        else:
            inputs = [input_]

        outputs = [row(inputs, functools.partial(self._reduce_row, out_id)) for out_id, row in enumerate(self.linears)]

        if self.combine_out_splits:
            return self._combine_output_splits(outputs)
        return outputs

    def _row(self, out_id: int) -> TileRow:
        return cast(TileRow, self.linears[out_id])  # (built as TileRows; ModuleList indexing is typed Module)

    def _reduce_row(self, out_id: int, in_id: int, current_out: Any, new_out: Any) -> Any:
        return self._reduce_local_output(in_id=in_id, out_id=out_id, current_out=current_out, new_out=new_out)

    def _split_global_input(self, input: Any, split_sizes: list[int]) -> Sequence[Any]:
        """The input cut along its last dimension into chunks of `split_sizes`; a subclass taking other input types
        overrides it."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Tile (out_id, in_id)'s result added to the row's sum so far (None before the first tile); a subclass
        whose tiles return other types overrides it."""
        if current_out is None:
            # a copy, not the tile's own tensor: a subclass may add the later tiles into it in place, and a tile's
            # output may be a view of its input (DeepSpeed copies here, so autograd sees the same graph)
            return new_out.clone()
        return current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """The rows' results joined along the last dimension."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy `other`'s weight (out_features x in_features) and bias into the tiles.

        Under zeroshard's stage 3 this is a collective (call it on every rank): each tile is changed inside
        `GatheredParameters(..., modifier_rank=0)`, so rank 0's values reach every rank, and `other`'s own
        parameters are gathered first when they are sharded.
        """
        weight = getattr(other, "weight", None)
        if weight is None:
            raise TilingError(f"TiledLinear.copy_params_from: {type(other).__name__} has no weight to copy")
        other_bias = getattr(other, "bias", None)
        if self.use_bias and other_bias is None:
            raise TilingError("TiledLinear.copy_params_from: this layer has a bias and the source has none")
        if not self.use_bias and other_bias is not None:
            raise TilingError(
                "TiledLinear.copy_params_from: the source has a bias and this layer has none (bias=False)"
            )
        sources = [t for t in (weight, other_bias) if isinstance(t, nn.Parameter)]
        with GatheredParameters(sources):
            self._copy_gathered(weight, other_bias)

    def _copy_gathered(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise TilingError(
                f"TiledLinear.copy_params_from: the source weight is {tuple(weight.shape)}, "
                f"expected (out_features, in_features) = {(self.out_features, self.in_features)}"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise TilingError(
                f"TiledLinear.copy_params_from: the source bias is {tuple(bias.shape)}, expected ({self.out_features},)"
            )
        for out_id in range(self.out_splits):
            rows = slice(self.out_parts[out_id], self.out_parts[out_id + 1])
            for in_id in range(self.in_splits):
                cols = slice(self.in_parts[in_id], self.in_parts[in_id + 1])
                tile_weight = _tile_param(self._row(out_id)[in_id], "weight")
                with GatheredParameters(tile_weight, modifier_rank=0):
                    tile_weight.copy_(weight[rows, cols])
            if bias is not None:
                tile_bias = _tile_param(self._row(out_id)[self.in_splits - 1], "bias")
                with GatheredParameters(tile_bias, modifier_rank=0):
                    tile_bias.copy_(bias[rows])


class TiledLinearReturnBias(TiledLinear):
    """A TiledLinear whose tiles return `(output, bias)` (Megatron-LM's linears, which leave the bias addition to a
    later fused kernel): `forward` returns `(output, bias)`, the bias the rows' returned biases joined (None when no
    tile returned one); with `combine_out_splits=False`, the list of each row's `(output, bias)`."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """The row's outputs summed as TiledLinear's; its returned bias is the last one a tile returned."""
        if not isinstance(new_out, tuple) or len(new_out) != 2 or new_out[0] is None:
            raise TilingError(
                f"TiledLinearReturnBias: linear_cls {type(self._row(out_id)[in_id]).__name__} must return a "
                f"(tensor, bias) pair, got {type(new_out).__name__}; use TiledLinear for tiles that return a tensor"
            )
        old_tensor, old_bias = (None, None) if current_out is None else current_out
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, old_bias if bias is None else bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([out for out, _ in outputs])
        biases = [bias for _, bias in outputs if bias is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None


__all__ = ["TileRow", "TiledLinear", "TiledLinearReturnBias", "TilingError", "split_tensor_along_last_dim"]
