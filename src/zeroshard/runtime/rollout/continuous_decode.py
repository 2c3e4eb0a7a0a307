"""Greedy decoding in a continuous batch: `SamplingConfig.continuous_batch_size` rows live at once, a finished row's
place taken by the next prompt before the next decode step (DeepSpeed 0.19.8's experimental rollout path).

[Note: continuous decode over the model's own cache]
Each live row keeps its prompt's and its tokens' keys and values in one cache of shared width: rows are right-aligned
(their newest column last), a row that entered later has unattended columns on its left, and each row's attention
mask and position count only its own columns. So every row decodes exactly as its prompt would alone: positions are
the attended columns counted (a prefill's are the mask's running count, padding at 1, as transformers and DeepSpeed
number them), the next token is the argmax of the logits after the model's `generation_config.repetition_penalty`,
and a row retires at its first EOS (kept in the response) or at `max_new_tokens`. Between steps the cache is the
model's own `DynamicCache` rebuilt from the rows' tensors; DeepSpeed uses a static cache with per-row write positions.
Columns no live row attends (a retired row's, or padding every live row has) are dropped: with
`enable_cache_trimming` after every change of rows, otherwise when the next step would pass the cache's capacity
(`continuous_cache_capacity`, by default the prompt width plus `max_new_tokens` - 1: the most one row needs, so
trimming always makes room). `align_decode_fronts` prefills each prompt without its left padding (the cache never holds
those columns) and admits the longest prompts first, as DeepSpeed orders them.
Stage 3 holds the whole model gathered for the decode ([Note: generation at stage 3]'s one gather), since the ranks'
rows finish at different steps and their forwards must not gather unit by unit in lockstep.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.runtime.rollout.base import RolloutRequest, SamplingConfig
from zeroshard.runtime.rollout.continuous_batching import ContinuousBatchRequest, ContinuousBatchScheduler


def _refuse(why: str) -> ValueError:
    return ValueError(f"SamplingConfig.continuous_batch_size: {why}")


def check_continuous(request: RolloutRequest, sampling: SamplingConfig, rows: int, shared_prefill: bool) -> None:
    """DeepSpeed's limits of its continuous path, each a one-line ValueError before any work."""
    if request.prompt_ids.shape[0] == 0:
        raise _refuse("the request holds no prompt")
    if rows <= 0:
        raise _refuse(f"must be positive, got {rows}")
    if shared_prefill:
        raise _refuse("not with use_shared_prefill; set one of them off")
    if sampling.max_new_tokens <= 0:
        raise _refuse(f"max_new_tokens must be positive, got {sampling.max_new_tokens}")
    if sampling.temperature > 0:
        raise _refuse("greedy decoding only (temperature 0)")
    if sampling.n_samples_per_prompt != 1:
        raise _refuse("one sample per prompt only (n_samples_per_prompt 1)")
    if not bool(request.prompt_attention_mask.bool().any(dim=1).all()):
        raise _refuse("every prompt needs at least one attended token")


# generation_config fields whose logits processors the model's generate applies to greedy decoding and this decode
# does not (it applies the repetition penalty alone)
_PROCESSORS = (
    "no_repeat_ngram_size",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "dola_layers",
    "guidance_scale",
    "watermarking_config",
)


def _check_generation_config(module: nn.Module) -> None:
    generation = getattr(module, "generation_config", None)
    if generation is None:
        return
    defaults = type(generation)()
    for name in _PROCESSORS:
        value = getattr(generation, name, None)
        if value != getattr(defaults, name, None):
            raise _refuse(
                f"the model's generation_config.{name}={value!r} changes greedy decoding in its generate, which "
                "the continuous decode does not apply (it applies repetition_penalty alone); reset it, or decode "
                "without continuous batching"
            )


def _check_model(module: nn.Module, longest: int, capacity: int) -> None:
    _check_generation_config(module)
    config = getattr(module, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"} or (not kinds and getattr(config, "sliding_window", None)):
        raise _refuse(
            "the model's layers are not all full attention (a sliding window or a recurrent state); "
            "decode it without continuous batching"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and longest > limit:
        raise _refuse(f"a prompt plus max_new_tokens ({longest}) exceeds the model's max_position_embeddings ({limit})")
    if limit is not None and capacity > limit:
        raise _refuse(f"the cache capacity {capacity} exceeds the model's max_position_embeddings ({limit})")


def _synced_time(sync: bool) -> float:
    if sync and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _new_cache(config: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers releases whose DynamicCache takes no config
        return DynamicCache()


def _cache_tensors(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    return list(cache.key_cache), list(cache.value_cache)


@dataclass
class _Rows:
    """The live rows ([Note: continuous decode over the model's own cache]): per layer keys and values [rows, heads,
    width, dim], the mask [rows, width], each row's next position and its token not yet fed to the model."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    positions: torch.Tensor
    pending: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    def select(self, slots: torch.Tensor) -> _Rows:
        return _Rows(
            [k.index_select(0, slots) for k in self.keys],
            [v.index_select(0, slots) for v in self.values],
            self.mask.index_select(0, slots),
            self.positions.index_select(0, slots),
            self.pending.index_select(0, slots),
        )

    def widen(self, width: int) -> _Rows:
        """Unattended columns on the left up to `width`."""
        extra = width - self.width
        if extra <= 0:
            return self
        return _Rows(
            [F.pad(k, (0, 0, extra, 0)) for k in self.keys],
            [F.pad(v, (0, 0, extra, 0)) for v in self.values],
            F.pad(self.mask, (extra, 0)),
            self.positions,
            self.pending,
        )

    def join(self, other: _Rows) -> _Rows:
        width = max(self.width, other.width)
        a, b = self.widen(width), other.widen(width)
        return _Rows(
            [torch.cat(pair) for pair in zip(a.keys, b.keys, strict=True)],
            [torch.cat(pair) for pair in zip(a.values, b.values, strict=True)],
            torch.cat([a.mask, b.mask]),
            torch.cat([a.positions, b.positions]),
            torch.cat([a.pending, b.pending]),
        )

    def dead_prefix(self) -> int:
        """Leading columns no row attends."""
        attended = self.mask.bool().any(dim=0)
        return int(attended.long().argmax()) if bool(attended.any()) else self.width

    def drop_left(self, columns: int) -> _Rows:
        return _Rows(
            [k[:, :, columns:] for k in self.keys],
            [v[:, :, columns:] for v in self.values],
            self.mask[:, columns:],
            self.positions,
            self.pending,
        )

    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, self.mask]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Stats:
    """DeepSpeed's `get_last_continuous_stats()` keys."""

    cache_capacity: int
    peak_cache_length: int = 0
    cache_memory_bytes: int = 0
    trim_count: int = 0
    trimmed_columns: int = 0
    trim_latency_ms: float = 0.0
    decode_steps: int = 0
    trim_bytes_moved: int = 0  # a trim keeps views of the live columns (the next step's cache update copies them)


class ContinuousDecode:
    """One continuous-batching `generate`: `run()` returns each request's response tokens, in request order."""

    def __init__(self, module: nn.Module, tokenizer: Any, settings: Any, sampling: SamplingConfig, rows: int) -> None:
        self.module, self.settings, self.rows = module, settings, rows
        # with enable_profiling: forward times (host time after synchronising the device) and counts, per kind
        self.profile: dict[str, float] = dict.fromkeys(
            (
                "prefill_forward_ms",
                "decode_forward_ms",
                "num_prefill_forwards",
                "num_decode_forwards",
                "scheduler_overhead_ms",
                "cache_management_overhead_ms",
            ),
            0.0,
        )
        self.active_batch_size = 0
        # transformers 5.x names the forward's cache argument `cache` (`past_key_values` warns); earlier releases not
        forward_args = inspect.signature(module.forward).parameters
        self._cache_name = "cache" if "cache" in forward_args else "past_key_values"
        self.max_new = sampling.max_new_tokens
        eos = tokenizer.eos_token_id
        self.eos = None if eos is None else torch.as_tensor(eos).reshape(-1)
        penalty = getattr(getattr(module, "generation_config", None), "repetition_penalty", None)
        self.penalty = 1.0 if penalty is None else float(penalty)

    def run(self, request: RolloutRequest, engine: Any) -> tuple[list[list[int]], dict[str, Any]]:
        ids, mask = request.prompt_ids, request.prompt_attention_mask
        width = ids.shape[1]
        first = mask.bool().long().argmax(dim=1).tolist()
        self._prompts = [ids[i, first[i] :] for i in range(ids.shape[0])]
        lengths = mask.sum(dim=1).tolist() if self.settings.align_decode_fronts else [width] * ids.shape[0]
        self._needed = max(lengths) + self.max_new - 1  # one row's columns at its last decode step
        configured = self.settings.continuous_cache_capacity
        capacity = self._needed if configured is None else configured
        if capacity < max(lengths):
            raise _refuse(f"continuous_cache_capacity {capacity} is below the prompt width {max(lengths)}")
        _check_model(self.module, max(lengths) + self.max_new, capacity)
        stats = _Stats(cache_capacity=capacity)
        order: list[int] = list(range(ids.shape[0]))
        if self.settings.align_decode_fronts:  # the longest first, as DeepSpeed admits them
            order = sorted(order, key=lambda i: -lengths[i])
        with self._timed("scheduler_overhead_ms"):
            scheduler = ContinuousBatchScheduler(self.rows, self.max_new)
            for i in order:
                scheduler.submit(ContinuousBatchRequest(i))
        responses: dict[Any, list[int]] = {i: [] for i in range(ids.shape[0])}
        live: _Rows | None = None
        stage3 = getattr(engine, "zero_stage", 0) == 3 and hasattr(engine, "gathered_for_generation")
        with engine.gathered_for_generation() if stage3 else contextlib.nullcontext():
            with self._timed("scheduler_overhead_ms"):
                update = scheduler.schedule()
            while update.active:
                if live is not None and update.keep_slots:
                    with self._timed("cache_management_overhead_ms"):
                        live = live.select(torch.tensor(update.keep_slots, device=ids.device))
                    if update.retired and self.settings.enable_cache_trimming:
                        live = self._trim(live, stats)
                else:
                    live = None
                fresh = self._prefill(ids, mask, [r.request_id for r in update.admitted], responses)
                if live is not None:
                    live = self._decode(live, update.active_ids[: len(update.keep_slots)], responses, stats, capacity)
                if live is None or fresh is None:
                    live = live if fresh is None else fresh
                else:
                    with self._timed("cache_management_overhead_ms"):
                        live = live.join(fresh)
                assert live is not None  # the active rows are the kept and the admitted
                self.active_batch_size = max(self.active_batch_size, len(update.active))
                stats.peak_cache_length = max(stats.peak_cache_length, live.width)
                stats.cache_memory_bytes = max(stats.cache_memory_bytes, live.nbytes())
                finished = [i for i in update.active_ids if self._is_eos(responses[i][-1])]
                with self._timed("scheduler_overhead_ms"):
                    update = scheduler.advance(finished)
        report: dict[str, Any] = dict(vars(stats))
        report["trim_frequency"] = stats.trim_count / stats.decode_steps if stats.decode_steps else 0.0
        return [responses[i] for i in range(ids.shape[0])], report

    @contextlib.contextmanager
    def _timed(self, field: str) -> Iterator[None]:
        """With enable_profiling, the block's time (the device synchronised at both ends) added to `field`."""
        if not self.settings.enable_profiling:
            yield
            return
        start = _synced_time(True)
        yield
        self.profile[field] += (_synced_time(True) - start) * 1000.0

    def _is_eos(self, token: int) -> bool:
        return self.eos is not None and bool((self.eos == token).any())

    def _next(self, logits: torch.Tensor, request_ids: list[Any], responses: dict[Any, list[int]]) -> torch.Tensor:
        """Greedy tokens, after the model's repetition penalty where it has one: transformers 5's rule, over the
        prompt from its first attended token and the response (DeepSpeed's path and older transformers count the
        left padding too)."""
        if self.penalty != 1.0:
            logits = logits.clone()
            for row, i in enumerate(request_ids):
                prompt = self._prompts[i]
                seen = torch.cat([prompt, torch.tensor(responses[i], dtype=prompt.dtype, device=prompt.device)])
                scores = logits[row].gather(0, seen)
                scores = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
                logits[row].scatter_(0, seen, scores)
        return logits.argmax(dim=-1)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, rows: _Rows | None
    ) -> tuple[Any, Any]:
        """The model's output and the cache it filled (ours, filled in place)."""
        cache = _new_cache(getattr(self.module, "config", None))
        if rows is not None:
            for layer, (k, v) in enumerate(zip(rows.keys, rows.values, strict=True)):
                cache.update(k, v, layer)
        kind = "prefill" if rows is None else "decode"
        start = _synced_time(self.settings.enable_profiling)
        out = self.module(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_name: cache}
        )
        if self.settings.enable_profiling:
            self.profile[f"{kind}_forward_ms"] += (_synced_time(True) - start) * 1000.0
            self.profile[f"num_{kind}_forwards"] += 1
        return out, cache

    def _prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, admitted: list[Any], responses: dict[Any, list[int]]
    ) -> _Rows | None:
        if not admitted:
            return None
        if self.settings.align_decode_fronts:  # each prompt alone, without its left padding
            parts = [
                self._prefill_rows(ids[i : i + 1, mask[i].bool()], mask[i : i + 1, mask[i].bool()], [i], responses)
                for i in admitted
            ]
            joined = parts[0]
            for part in parts[1:]:
                joined = joined.join(part)
            return joined
        index = torch.tensor(admitted, device=ids.device)
        return self._prefill_rows(ids.index_select(0, index), mask.index_select(0, index), admitted, responses)

    def _prefill_rows(
        self,
        prompt: torch.Tensor,
        mask: torch.Tensor,
        admitted: list[Any],
        responses: dict[Any, list[int]],
    ) -> _Rows:
        positions = (mask.long().cumsum(dim=1) - 1).masked_fill(mask == 0, 1)
        out, cache = self._forward(prompt, mask, positions, None)
        tokens = self._next(out.logits[:, -1, :], admitted, responses)
        for i, token in zip(admitted, tokens.tolist(), strict=True):
            responses[i].append(token)
        keys, values = _cache_tensors(cache)
        return _Rows(keys, values, mask.long(), mask.long().sum(dim=1), tokens)

    def _decode(
        self,
        live: _Rows,
        request_ids: tuple[Any, ...],
        responses: dict[Any, list[int]],
        stats: _Stats,
        capacity: int,
    ) -> _Rows:
        if live.width + 1 > capacity:
            live = self._trim(live, stats)
            if live.width + 1 > capacity:
                raise _refuse(
                    f"the cache capacity ({capacity}) is exhausted before the live requests retired; raise "
                    f"continuous_cache_capacity to the prompt width plus max_new_tokens - 1 ({self._needed})"
                )
        mask = F.pad(live.mask, (0, 1), value=1)
        out, cache = self._forward(live.pending[:, None], mask, live.positions[:, None], live)
        tokens = self._next(out.logits[:, -1, :], list(request_ids), responses)
        for i, token in zip(request_ids, tokens.tolist(), strict=True):
            responses[i].append(token)
        stats.decode_steps += 1
        keys, values = _cache_tensors(cache)
        return _Rows(keys, values, mask, live.positions + 1, tokens)

    def _trim(self, live: _Rows, stats: _Stats) -> _Rows:
        dead = live.dead_prefix()
        if dead == 0:
            return live
        start = _synced_time(self.settings.enable_profiling)
        with self._timed("cache_management_overhead_ms"):
            trimmed = live.drop_left(dead)
        stats.trim_count += 1
        stats.trimmed_columns += dead
        stats.trim_latency_ms += (_synced_time(self.settings.enable_profiling) - start) * 1000.0
        return trimmed
