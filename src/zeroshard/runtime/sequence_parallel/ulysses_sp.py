"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: Ulysses for Hugging Face Transformers models (DeepSpeed's
Arctic Long Sequence Training entry points), over zeroshard's exchange (sequence/layer.py); ALST's tiled compute
helpers (`TiledMLP`, `sequence_tiled_compute`, `TiledFusedLogitsLoss`) are sequence/tiled.py's.

[Note: Ulysses for Hugging Face models]
`UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", P, micro_batch_size)` makes the sequence-parallel
groups (`parallel_state_sp`, returned as the mpu for `initialize(mpu=...)`) and puts a wrapper under the model's
attention implementation's key in transformers' `ALL_ATTENTION_FUNCTIONS`, as DeepSpeed does, so every code path
that checks the implementation's name still runs. The wrapper receives a rank's part of the sequence with every
head ([bs, heads, seq/P, head_dim]), exchanges q, k, v to the whole sequence with the rank's heads (key/value heads
replicated first when there are fewer than P, and `module.num_key_value_groups` set to match, as DeepSpeed), runs
the original implementation without the attention mask (causal from position 0: the positions are all-gathered
along the sequence, so flash attention's packed-sequence detection sees the whole sequence) and exchanges the
output back. `UlyssesSPDataLoaderAdapter` takes one batch from each rank of the group, and gives the P ranks, in
turn, their part of each: input_ids, position_ids and `shift_labels` (labels shifted left, -100 at the end), so
a rank's loss over its part uses the next token even at a part's edge.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeroshard.sequence.layer import _SeqAllToAll, collectives_for, head_splits
from zeroshard.sequence.tiled import (  # noqa: F401  DeepSpeed's names for them live in this module
    AutogradComputeMLP,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

# a Hugging Face Hub kernel named as an attention implementation (kernels-community/flash-attn2, with an optional
# @revision and :kernel), which transformers registers in ALL_ATTENTION_FUNCTIONS only when it is first loaded
_HUB_KERNEL = re.compile(r"^[^/:@]+/[^/:@]+(@[^/:@]+)?(:[^/:@]+)?$")


class UlyssesSPAttentionHF(nn.Module):
    """[Note: Ulysses for Hugging Face models] the attention wrapper; DeepSpeed's constructor arguments."""

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size = attn_head_count, attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None
        if attn_head_count % self.world_size:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}")
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(
                f"KV attention head count {kv_head_count} is not divisible by SP size {self.world_size} or vice versa"
            )
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.splits = head_splits(attn_head_count, None, self.world_size)

    def forward(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        if not module.training and self.disable_in_eval:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
        if "position_ids" not in kwargs:
            raise ValueError(
                "Ulysses SP needs position_ids in every forward: each rank's part of the sequence must carry its "
                "global positions (torch.arange(seq_len) per sample; resetting at document boundaries when packed); "
                "UlyssesSPDataLoaderAdapter passes them through"
            )
        self._check(query, key)
        comm = collectives_for(self.process_group)
        kwargs["position_ids"] = _gather_sequence(kwargs["position_ids"], comm)
        if self.kv_replication_factor > 1:  # fewer key/value heads than ranks: each rank gets one copy
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        q, k, v = (self._to_heads(t) for t in (query, key, value))
        if self.kv_replication_factor > 1:  # as DeepSpeed: the query heads per key/value head on this rank
            module.num_key_value_groups = q.shape[1] // k.shape[1]  # type: ignore[assignment]
        context, weights = self.attn(module, q, k, v, None, *args, **kwargs)  # [bs, seq, heads/P, head_dim]
        output = _SeqAllToAll.apply(self.process_group, context, 1, 2, 0, None, None, None, True, None)
        return output.reshape(*output.shape[:2], -1), weights

    def _to_heads(self, t: Tensor) -> Tensor:
        """[bs, heads, seq/P, head_dim] -> [bs, heads/P, seq, head_dim] (heads split evenly: the kv heads were
        checked or replicated to a multiple of P)."""
        heads = _SeqAllToAll.apply(self.process_group, t.transpose(1, 2), 2, 1, 0, None, None, None, True, None)
        return heads.transpose(1, 2)

    def _check(self, query: Tensor, key: Tensor) -> None:
        if query.shape[1] != self.attn_head_count or query.shape[3] != self.attn_head_size:
            raise ValueError(
                f"query {tuple(query.shape)}: expected [batch, {self.attn_head_count} heads, seq/P, "
                f"{self.attn_head_size}] (the heads and head size the wrapper was registered with)"
            )
        if key.shape[1] != self.global_kv_head_count:
            raise ValueError(f"key {tuple(key.shape)}: expected {self.global_kv_head_count} key/value heads")
        if not self.seq_length_is_variable and query.shape[2] != self.local_seq_length:
            raise ValueError(
                f"a part of {query.shape[2]} tokens, registered with seq_length_is_variable=False and "
                f"{self.local_seq_length} per rank"
            )

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """[Note: Ulysses for Hugging Face models] make the groups and wrap the attention implementation; returns
        the mpu for `initialize(mpu=...)` (None when `sequence_parallel_size` is 1)."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("seq_length_is_variable=False needs seq_length (the fixed sequence length)")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from zeroshard.runtime.sequence_parallel import parallel_state_sp as mpu

        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        active = getattr(config, "_attn_implementation", None) if loaded else None
        if active is not None and active != core_attn_implementation:
            raise ValueError(
                f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                f"attn_implementation='{active}'; set both to the same value"
            )
        if core_attn_implementation in ("eager", "paged|eager", "flex_attention"):
            raise ValueError(
                f"{core_attn_implementation} attn_implementation is not supported by Ulysses sequence parallelism "
                "here (eager needs an O(seq^2) 4-D mask; flex_attention's block mask is not rebuilt); use sdpa or "
                "a flash attention implementation"
            )
        if _HUB_KERNEL.match(core_attn_implementation):  # "org/repo[@revision][:kernel]": registered on first use
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

            lazy_import_flash_attention(core_attn_implementation)
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(
                f"{core_attn_implementation} is not a valid attn_implementation; the choices are "
                f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}"
            )
        # a second registration in this process (another Trainer, another model) replaces the first, groups and
        # wrapper (DeepSpeed's raises "already initialized" and would wrap its own wrapper)
        if mpu._GROUPS.made:
            mpu._release_sequence_parallel_groups()
        mpu.initialize_sequence_parallel(sequence_parallel_size)
        original = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        original = getattr(original, "ulysses_wraps", original)
        text = config.get_text_config()
        local = None if seq_length_is_variable or seq_length is None else seq_length // sequence_parallel_size
        wrapper = cls(
            attn=original,
            batch_size=micro_batch_size,
            attn_head_count=text.num_attention_heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            kv_head_count=text.num_key_value_heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=local,
            global_seq_length=None if local is None else seq_length,
            disable_in_eval=disable_in_eval,
        )
        wrapper.core_attn_implementation = core_attn_implementation

        def attention(
            module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, *args: Any, **kw: Any
        ) -> tuple[Tensor, Any]:
            return wrapper(module, query, key, value, None, *args, **kw)  # masks are per part: dropped

        attention.ulysses_wraps = original  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = attention
        return mpu


def _gather_sequence(ids: Tensor, comm: Any) -> Tensor:
    """Every rank's part of [bs, seq/P] integer ids, in rank order along the sequence (not differentiated)."""
    rows = ids.transpose(0, 1).contiguous()  # [seq/P, bs]: the parts concatenate along dim 0
    out = rows.new_empty((comm.world_size * rows.shape[0], *rows.shape[1:]))
    comm.all_gather(out, rows, label="ulysses position_ids")
    return out.transpose(0, 1).contiguous()


class UlyssesSPDataLoaderAdapter:
    """[Note: Ulysses for Hugging Face models] DeepSpeed's adapter: each refill takes one batch from every rank of
    the group, and the next P iterations give this rank its part of each, in rank order."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts from a fresh iterator
            raise
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses SP needs position_ids in every dataloader batch, so that each token keeps its global "
                "position once the sequence is split (torch.arange(seq_len) per sample; resetting at document "
                "boundaries when packed); add them in the collator"
            )
        seq = batch["input_ids"].shape[1]
        for name, value in batch.items():
            if torch.is_tensor(value) and value.shape[1] != seq:
                raise ValueError(
                    f"{name}'s shape {tuple(value.shape)} must match input_ids's {tuple(batch['input_ids'].shape)}"
                )
        every = [None] * self.sp_world_size
        dist.all_gather_object(
            every, {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}, self.sp_group
        )
        for theirs in every:
            assert theirs is not None
            self.micro_batches.append(self._part(theirs))

    def _part(self, batch: dict[str, Any]) -> dict[str, Any]:
        seq = batch["input_ids"].shape[1]
        if seq % self.sp_world_size:
            raise ValueError(f"batch's seqlen={seq} isn't divisible by sp-size={self.sp_world_size}")
        chunk = seq // self.sp_world_size
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        cut = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
        return {k: v[:, cut] if torch.is_tensor(v) else v for k, v in batch.items()}
