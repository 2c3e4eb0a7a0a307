"""`deepspeed.sequence.layer`: Ulysses' all-to-all and `DistributedAttention` ([Note: sequence parallelism]).

[Note: Ulysses all-to-all]
q, k and v arrive as [batch, seq/P, heads, head_dim] (`batch_dim_idx` 0) or [seq/P, batch, heads, head_dim]
(`batch_dim_idx` 1). The forward exchange sends rank j the heads it attends over, from every rank's part of the
sequence, so rank j holds [.., seq, heads_j, ..] with the sequence in rank order; the backward exchange and the
output's exchange are the inverse. Heads split as DeepSpeed splits them: the key/value heads as evenly as they
go, the first `kv_heads % P` ranks one more, and every query head goes with its key/value head (GQA: a rank's
query heads are its key/value heads times the group size). Each exchange is one all-to-all of a tensor laid out
heads-first, so an uneven split is the same call with uneven row counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeroshard.comm.collectives import Collectives
from zeroshard.utils import groups as parallel_groups
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


def head_splits(heads: int, kv_heads: int | None, world_size: int) -> list[int]:
    """[Note: Ulysses all-to-all] the heads each rank of a `world_size`-rank group attends over. Pure."""
    kv = kv_heads if kv_heads is not None else heads
    if kv < world_size:
        raise ValueError(
            f"{kv} key/value heads over a sequence-parallel group of {world_size}: a rank would have no head; "
            "use a sequence_parallel_size of at most the key/value head count"
        )
    if heads % kv:
        raise ValueError(f"{heads} heads are not a multiple of {kv} key/value heads (num_kv_heads)")
    per_rank = [kv // world_size + (1 if r < kv % world_size else 0) for r in range(world_size)]
    return [heads * n // kv for n in per_rank]


def seq_to_heads(x: Tensor, comm: Collectives, batch_dim_idx: int, splits: list[int]) -> Tensor:
    """[.., seq/P, heads, d] -> [.., seq, splits[rank], d] ([Note: Ulysses all-to-all])."""
    world, mine = comm.world_size, splits[comm.rank]
    rows = x.movedim(2, 0).contiguous()  # [heads, b, s/P, d] or [heads, s/P, b, d]
    out = rows.new_empty((world * mine, *rows.shape[1:]))
    comm.all_to_all_uneven(out, rows, [mine] * world, splits, label="ulysses")
    out = out.view(world, mine, *rows.shape[1:])
    if batch_dim_idx == 0:  # [P, h, b, s/P, d] -> [b, P, s/P, h, d]
        b, s, d = rows.shape[1], rows.shape[2], rows.shape[3]
        return out.permute(2, 0, 3, 1, 4).reshape(b, world * s, mine, d)
    s, b, d = rows.shape[1], rows.shape[2], rows.shape[3]  # [P, h, s/P, b, d] -> [P, s/P, b, h, d]
    return out.permute(0, 2, 3, 1, 4).reshape(world * s, b, mine, d)


def heads_to_seq(y: Tensor, comm: Collectives, batch_dim_idx: int, splits: list[int]) -> Tensor:
    """[.., seq, splits[rank], d] -> [.., seq/P, heads, d], the inverse of `seq_to_heads`."""
    world, mine = comm.world_size, splits[comm.rank]
    if batch_dim_idx == 0:
        b, seq, _, d = y.shape
        rows = y.reshape(b, world, seq // world, mine, d).permute(1, 3, 0, 2, 4)  # [P, h, b, s/P, d]
    else:
        seq, b, _, d = y.shape
        rows = y.reshape(world, seq // world, b, mine, d).permute(0, 3, 1, 2, 4)  # [P, h, s/P, b, d]
    rows = rows.reshape(world * mine, *rows.shape[2:]).contiguous()
    out = rows.new_empty((sum(splits), *rows.shape[1:]))
    comm.all_to_all_uneven(out, rows, splits, [mine] * world, label="ulysses")
    return out.movedim(0, 2).contiguous()


def _check_layout(x: Tensor, to_heads: bool, batch_dim_idx: int, world_size: int) -> None:
    if x.dim() != 4:
        raise ValueError(
            f"sequence-parallel all-to-all: expected a 4-D [.., seq, heads, head_dim] tensor, got {x.dim()}-D"
        )
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx must be 0 ([batch, seq, ..]) or 1 ([seq, batch, ..]), got {batch_dim_idx}")
    seq = x.shape[1 - batch_dim_idx]
    if not to_heads and seq % world_size:
        raise ValueError(f"a sequence of {seq} does not split over {world_size} sequence-parallel ranks")


def collectives_for(group: Any) -> Collectives:
    """The engine's sequence-parallel collectives when `group` is theirs or None (counted in its counters);
    otherwise uncounted collectives over `group`."""
    published = parallel_groups.sequence_parallel_collectives()
    # (a mesh over the whole world publishes its group as None, the mpu's `parallel_state_sp` as WORLD: the same)
    world = published is not None and published.group is None and group is dist.group.WORLD
    if published is not None and (group is None or group is published.group or world):
        return published
    if group is None:
        raise ValueError(
            "no sequence-parallel group: pass sequence_process_group, or set sequence_parallel_size in the config "
            "and call zeroshard.initialize before the first forward"
        )
    return Collectives(group, dist.get_world_size(group), dist.get_rank(group))


class _SeqAllToAll(torch.autograd.Function):
    """DeepSpeed's `_SeqAllToAll`: `scatter_idx` 2 sends heads away and gathers the sequence; `scatter_idx` < 2 is
    the inverse. The sequence dimension follows from `batch_dim_idx` (as in DeepSpeed, `gather_idx` is not read).
    Backward is the other direction over the same heads. DeepSpeed's overlap arguments (`stream`, `handle`,
    `type`) are accepted; the exchange is synchronous."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        group: Any,
        input: Tensor,
        scatter_idx: int,
        gather_idx: int,
        batch_dim_idx: int,
        stream: Any = None,
        handle: Any = None,
        type: Any = None,
        is_fwd: bool = True,
        num_kv_heads: int | None = None,
    ) -> Tensor:
        comm = collectives_for(group)
        to_heads = scatter_idx >= 2
        _check_layout(input, to_heads, batch_dim_idx, comm.world_size)
        if to_heads:
            splits = head_splits(input.shape[2], num_kv_heads, comm.world_size)
        else:  # a rank's heads are its key/value heads times the group size: the total follows from them
            kv = num_kv_heads if num_kv_heads is not None else input.shape[2] * comm.world_size
            kv_mine = head_splits(kv, kv, comm.world_size)[comm.rank]
            splits = head_splits(input.shape[2] * kv // kv_mine, kv, comm.world_size)
        ctx.comm, ctx.to_heads, ctx.batch_dim_idx, ctx.splits = comm, to_heads, batch_dim_idx, splits
        move = seq_to_heads if to_heads else heads_to_seq
        return move(input, comm, batch_dim_idx, splits)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[Any, ...]:
        move = heads_to_seq if ctx.to_heads else seq_to_heads
        grad = move(grad_output[0].contiguous(), ctx.comm, ctx.batch_dim_idx, ctx.splits)
        return (None, grad, None, None, None, None, None, None, None, None)


def single_all_to_all(
    input: Tensor,
    scatter_idx: int,
    gather_idx: int,
    batch_dim_idx: int,
    group: Any,
    async_op: bool = False,
    handle: Any = None,
    type: Any = None,
    num_kv_heads: int | None = None,
) -> Tensor:
    """DeepSpeed's non-differentiable exchange (synchronous: `async_op` is DeepSpeed's overlap path)."""
    with torch.no_grad():
        return _SeqAllToAll.apply(
            group, input, scatter_idx, gather_idx, batch_dim_idx, None, None, None, True, num_kv_heads
        )


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary embedding over the first `freqs_cos.shape[-1]` features of `t` (DeepSpeed's rotate-half form)."""
    rot_dim = freqs_cos.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + _rotate_half(rotated) * freqs_sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)


class DistributedAttention(nn.Module):
    """DeepSpeed-Ulysses attention ([Note: sequence parallelism]): all-to-all q, k, v from a rank's part of the
    sequence to a part of the heads, `local_attention` over the whole sequence, all-to-all back.

    `sequence_process_group` None means the engine's (`sequence_parallel_size` in the config), resolved at the
    first forward. `num_kv_heads` is read off the key tensor when not given.

    Example:
        >>> from zeroshard.sequence.layer import DistributedAttention
        >>> def sdpa(q, k, v):  # [b, s, h, d] in, [b, s, h, d] out
        ...     out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
        ...                                                            v.transpose(1, 2), is_causal=True)
        ...     return out.transpose(1, 2)
        >>> attention = DistributedAttention(sdpa, None)  # doctest: +SKIP
        >>> out = attention(q, k, v, batch_dim_idx=0)  # q, k, v: [b, s/P, heads, d]  # doctest: +SKIP
    """

    def __init__(
        self,
        local_attention: Any,
        sequence_process_group: Any = None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads
        self.sp_stream = sp_stream
        self.sp_overlap_comm = False  # DeepSpeed's overlap state: the exchanges are synchronous here
        self.overlap_handles = None
        if sp_stream is not None:
            logger.warning(
                "DistributedAttention(sp_stream=...): DeepSpeed's overlap of the dq/dk all-to-alls with the "
                "projections' backward is not implemented; the all-to-alls run on the current stream"
            )

    def layer_sync(self, layer: Any) -> None:
        """DeepSpeed's wait for an overlapped layer's event: nothing to wait for, the exchanges are synchronous."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        kv = self.num_kv_heads if self.num_kv_heads is not None else key.shape[2]
        scatter, gather = self.scatter_idx, 1 - batch_dim_idx
        q, k, v = (
            _SeqAllToAll.apply(self.spg, t, scatter, gather, batch_dim_idx, None, None, None, True, kv)
            for t in (query, key, value)
        )
        if rotary_pos_emb is not None:  # DeepSpeed's [seq, batch, 1, dim] frequencies
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, gather, scatter, batch_dim_idx, None, None, None, True, kv)
