"""`HybridEngineRollout`: the training engine generates the rollout with the weights it trains (DeepSpeed 0.19.8's
`deepspeed.runtime.rollout.hybrid_engine_rollout`).

[Note: rollout through the training engine]
`generate` runs the model's own `generate` through `engine.module.generate`, so stage 3 gathers as any generation
there does ([Note: generation at stage 3], [Note: hybrid engine]: with `hybrid_engine.enabled` the whole model once per
call). As DeepSpeed's rollout, it asks for exactly `max_new_tokens` tokens (`eos_token_id=None`: every rank and row
runs the same number of decode forwards, which stage 3's lockstep gathers need without the hybrid engine) and then
restores what stopping at EOS would have given: a response keeps its first EOS (attended, even when EOS is the pad
id) and every later token becomes padding, unattended. With `n_samples_per_prompt` = n each prompt's n responses are
adjacent rows. The call and its post-processing are DeepSpeed's, so on the same weights and RNG state the batch is
DeepSpeed's to the bit (`tests/compat/scripts/opsd_rollout.py`).

`use_shared_prefill` (n > 1): the prompts' first forward runs once per prompt instead of once per sample, and its
key-value cache and last logits are repeated n times before decoding starts. DeepSpeed builds this on its inference
kernels' workspace (refused at ZeRO stage 3, and for a model its kernels do not cover); here it is the model's own
cache (`DynamicCache.batch_repeat_interleave`, or the tuples of older caches), for any transformers model at any
stage. Decoding then sees the same prompt state as without it (to rounding: a prefill over B rows instead of B * n).

`SamplingConfig.continuous_batch_size` decodes greedily in a continuous batch ([Note: continuous decode over the
model's own cache] in continuous_decode.py, on `continuous_batching.ContinuousBatchScheduler`).

Not here (one line at the call, before any work): `use_graph_capture` with greedy decoding (DeepSpeed's greedy decode
replays a CUDA graph over its static cache; on the CPU its accelerator's graphs do nothing).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig
from zeroshard.runtime.rollout.continuous_decode import ContinuousDecode, check_continuous


@dataclass
class HybridEngineRolloutConfig:
    """`HybridEngineRollout`'s settings (any object with these attributes will do: a trainer's `RolloutConfig`).

    Attributes:
        use_graph_capture: greedy decoding through a captured CUDA graph (refused here: [Note: rollout through the
            training engine]).
        enable_profiling: each `generate` times its phases and forwards (`get_last_profile()`).
        use_shared_prefill: with several samples per prompt, the prompt's forward runs once per prompt.
        align_decode_fronts, enable_cache_trimming, continuous_cache_capacity: settings of the continuous-batching
            decode (`SamplingConfig.continuous_batch_size`; [Note: continuous decode over the model's own cache]).
    """

    use_graph_capture: bool = False
    enable_profiling: bool = False
    use_shared_prefill: bool = False
    align_decode_fronts: bool = False
    enable_cache_trimming: bool = False
    continuous_cache_capacity: int | None = None


class _ForwardClock:
    """The duration of each top-level forward of a `generate` (the first is the prefill), timed without synchronising
    each call: CUDA events read at the end, host time where the work is synchronous (the CPU)."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[Any, Any]] = []
        self._start: Any = None
        self._handles = (
            module.register_forward_pre_hook(lambda *_: self._begin()),
            module.register_forward_hook(lambda *_: self._end()),
        )

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self) -> None:
        self._start = self._now()

    def _end(self) -> None:
        self._marks.append((self._start, self._now()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def stages_ms(self) -> tuple[float | None, float | None, int]:
        """(prefill ms, decode ms summed, decode forwards)."""
        if not self._marks:
            return None, None, 0
        if self._cuda:
            torch.cuda.synchronize()
            spans = [a.elapsed_time(b) for a, b in self._marks]
        else:
            spans = [(b - a) * 1000.0 for a, b in self._marks]
        return spans[0], sum(spans[1:]), len(spans) - 1


def _repeat_cache(cache: Any, repeats: int) -> Any:
    """A prompt's key-value cache for each of its `repeats` samples (adjacent rows)."""
    if hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(repeats)  # transformers' Cache objects repeat in place
        return cache
    if isinstance(cache, (tuple, list)):  # the legacy ((key, value), ...) per layer
        return tuple(tuple(t.repeat_interleave(repeats, dim=0) for t in layer) for layer in cache)
    raise ZeroshardError(
        f"use_shared_prefill: the model returned a {type(cache).__name__} cache, which cannot be repeated per sample; "
        "set use_shared_prefill false"
    )


class _SharedPrefill:
    """[Note: rollout through the training engine] The first forward of a `generate` over B * n rows runs on every
    n-th row (each prompt once); its cache and logits come back repeated n times."""

    _PER_ROW = ("attention_mask", "position_ids", "token_type_ids")

    def __init__(self, module: nn.Module, prompts: int, repeats: int) -> None:
        self.rows, self.repeats = prompts * repeats, repeats
        self.pending, self.reduced = True, False
        self._handles = (
            module.register_forward_pre_hook(self._reduce, with_kwargs=True),
            module.register_forward_hook(self._expand, with_kwargs=True),
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _reduce(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.pending:
            return None
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ZeroshardError("use_shared_prefill: the model's generate passed no input_ids keyword to its forward")
        if ids.shape[0] != self.rows:
            raise ZeroshardError(
                f"use_shared_prefill: the prompt forward has {ids.shape[0]} rows, the rollout expanded {self.rows}"
            )
        if ids.shape[1] <= 1:
            raise ZeroshardError("use_shared_prefill: the prompts must be longer than one token")
        kwargs = dict(kwargs, input_ids=ids[:: self.repeats])
        for name in self._PER_ROW:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == self.rows:
                kwargs[name] = value[:: self.repeats]
        self.reduced = True
        return args, kwargs

    def _expand(self, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any) -> Any:
        if not self.pending:
            return None
        if not self.reduced:
            raise ZeroshardError("use_shared_prefill: the prompt forward was not reduced to one row per prompt")
        self.pending = False
        # transformers 5 names the output's cache `cache` (`past_key_values` still answers, with a warning)
        name = "cache" if isinstance(output, Mapping) and "cache" in output else "past_key_values"
        setattr(output, name, _repeat_cache(getattr(output, name), self.repeats))
        output.logits = output.logits.repeat_interleave(self.repeats, dim=0)
        return output


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("HybridEngineRollout: the tokenizer must define pad_token_id or eos_token_id")
    if not isinstance(pad, numbers.Integral):
        raise ValueError(
            f"HybridEngineRollout: the tokenizer has no pad_token_id and its eos_token_id {pad!r} is not one id to pad "
            "with; set tokenizer.pad_token_id"
        )
    return int(pad)


class HybridEngineRollout(RolloutEngine):
    """Rollouts generated by the training engine's model ([Note: rollout through the training engine]).

    Args:
        engine: the engine `initialize` returned (its `module` generates; a transformers model).
        tokenizer: anything with `pad_token_id` and `eos_token_id` (a Hugging Face tokenizer).
        cfg: a `HybridEngineRolloutConfig`, or any object with some of its attributes (the others take its defaults).

    Example:
        >>> rollout = HybridEngineRollout(engine, tokenizer)  # doctest: +SKIP
        >>> batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=64))  # doctest: +SKIP
    """

    name = "hybrid_engine"

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        defaults = HybridEngineRolloutConfig()

        def setting(name: str) -> Any:  # a field the object lacks takes the default
            return getattr(cfg, name, getattr(defaults, name))

        self.use_graph_capture: bool = setting("use_graph_capture")
        self.enable_profiling: bool = setting("enable_profiling")
        self.use_shared_prefill: bool = setting("use_shared_prefill")
        self.align_decode_fronts: bool = setting("align_decode_fronts")
        self.enable_cache_trimming: bool = setting("enable_cache_trimming")
        self.continuous_cache_capacity: int | None = setting("continuous_cache_capacity")
        self._last_profile: dict[str, Any] | None = None
        self._last_continuous_stats: dict[str, Any] | None = None

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """The request's prompts, each followed by `sampling.n_samples_per_prompt` responses of its own."""
        if sampling.continuous_batch_size is not None:
            return self._generate_continuous(request, sampling, sampling.continuous_batch_size)
        clock_start = self._sync_time()
        prompts, width = request.prompt_ids.shape
        n = sampling.n_samples_per_prompt
        pad = _pad_id(self.tokenizer)
        module = self.engine.module
        ids, mask = request.prompt_ids, request.prompt_attention_mask
        if n > 1:
            ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        expanded = self._sync_time()
        greedy = sampling.temperature <= 0.0
        graph = self.use_graph_capture and greedy
        clock = _ForwardClock(module, ids.device) if self.enable_profiling and not graph else None
        shared = None
        try:
            if self.use_shared_prefill and n > 1:
                if self.use_graph_capture:
                    raise ConfigError("use_shared_prefill: not with use_graph_capture; set one of them false")
                shared = _SharedPrefill(module, prompts, n)
            if graph:
                out = self._generate_graph(ids, mask, sampling.max_new_tokens, pad, module, ids.device)
            else:
                out = module.generate(ids, **self._generate_kwargs(sampling, mask, pad))
        finally:
            for hooks in (shared, clock):
                if hooks is not None:
                    hooks.remove()
        generated = self._sync_time()
        out, response_mask = self._pad_after_eos(out, width, self.tokenizer.eos_token_id, pad)
        attention = (out != pad).long()
        attention[:, width:] = response_mask
        attention[:, :width] = mask
        batch = RolloutBatch(
            input_ids=out,
            attention_mask=attention,
            response_start_idx=torch.full((prompts * n,), width, dtype=torch.long, device=request.prompt_ids.device),
        )
        if self.enable_profiling:
            self._last_profile = self._profile(
                (clock_start, expanded, generated, self._sync_time()), clock, out, width, prompts, n
            )
        return batch

    @staticmethod
    def _generate_kwargs(sampling: SamplingConfig, mask: torch.Tensor, pad: int) -> dict[str, Any]:
        sample = sampling.temperature > 0.0
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "max_new_tokens": sampling.max_new_tokens,
            "eos_token_id": None,  # every row decodes max_new_tokens: [Note: rollout through the training engine]
            "do_sample": sample,
            "temperature": max(sampling.temperature, 1e-8) if sample else 1.0,
            "top_p": sampling.top_p if sample else 1.0,
            "pad_token_id": pad,
        }
        if sample:
            kwargs["top_k"] = max(sampling.top_k, 0)
        return kwargs

    def _sync_time(self) -> float:
        """Host time, after the device's queued work when profiling (the phases' boundaries)."""
        if self.enable_profiling and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _profile(
        self,
        marks: tuple[float, float, float, float],
        clock: _ForwardClock | None,
        out: torch.Tensor,
        width: int,
        prompts: int,
        n: int,
    ) -> dict[str, Any]:
        start, expanded, generated, done = marks
        total_ms = (done - start) * 1000.0
        generation_ms = (generated - expanded) * 1000.0
        prefill_ms, decode_ms, decodes = clock.stages_ms() if clock is not None else (None, None, 0)
        overhead_ms = generation_ms
        if prefill_ms is not None and decode_ms is not None:
            overhead_ms = max(0.0, generation_ms - prefill_ms - decode_ms)
        response = int(out.shape[1] - width)
        tokens = int(out.shape[0]) * response
        return {
            "prompt_expansion_ms": (expanded - start) * 1000.0,
            "generation_ms": generation_ms,
            "prefill_forward_ms": prefill_ms,
            "decode_forward_ms": decode_ms,
            "generation_overhead_ms": overhead_ms,
            "num_decode_forwards": decodes,
            "post_processing_ms": (done - generated) * 1000.0,
            "total_ms": total_ms,
            "num_generated_tokens": tokens,
            "tokens_per_second": tokens / (total_ms / 1000.0) if total_ms > 0.0 else 0.0,
            "batch_size": prompts,
            "num_samples_per_prompt": n,
            "prompt_length": width,
            "response_length": response,
        }

    @staticmethod
    def _pad_after_eos(
        output_ids: torch.Tensor, response_start: int, eos_token_id: Any, pad_token_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, the responses' attention): each response keeps its first EOS (attended) and is padding after it."""
        response = output_ids[:, response_start:]
        attended = response != pad_token_id
        if eos_token_id is None or response.shape[1] == 0:
            return output_ids, attended.long()
        eos = torch.as_tensor(eos_token_id, dtype=response.dtype, device=response.device).reshape(-1)
        is_eos = torch.isin(response, eos)
        seen_before = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # an EOS earlier in the row
        first_eos = is_eos & ~seen_before
        output_ids = output_ids.clone()
        output_ids[:, response_start:].masked_fill_(seen_before, pad_token_id)
        return output_ids, ((attended | first_eos) & ~seen_before).long()

    def _generate_graph(
        self,
        prompt_ids: torch.Tensor,
        prompt_attn: torch.Tensor,
        max_new_tokens: int,
        pad_token_id: int,
        module: nn.Module,
        device: torch.device,
    ) -> torch.Tensor:
        raise ConfigError(
            "use_graph_capture: zeroshard's rollout does not capture CUDA graphs; set it false (greedy decoding then "
            "runs through the model's generate, the same tokens)"
        )

    def _generate_continuous(
        self, request: RolloutRequest, sampling: SamplingConfig, max_batch_size: int
    ) -> RolloutBatch:
        """[Note: continuous decode over the model's own cache]"""
        check_continuous(request, sampling, max_batch_size, self.use_shared_prefill)
        if self.use_graph_capture:
            self._generate_graph(
                request.prompt_ids, request.prompt_attention_mask, 0, 0, self.engine.module, request.prompt_ids.device
            )
        start = self._sync_time()
        decode = ContinuousDecode(self.engine.module, self.tokenizer, self, sampling, max_batch_size)
        responses, stats = decode.run(request, self.engine)
        generated = self._sync_time()
        batch = self._continuous_batch(request, responses)
        done = self._sync_time()
        tokens = sum(len(r) for r in responses)
        total_ms = (done - start) * 1000.0
        # measured with profiling only, as DeepSpeed's
        speed = tokens / (total_ms / 1000.0) if total_ms > 0.0 else 0.0
        stats["end_to_end_ms"] = total_ms if self.enable_profiling else None
        stats["tokens_per_second"] = speed if self.enable_profiling else None
        self._last_continuous_stats = stats
        if self.enable_profiling:
            generation_ms = (generated - start) * 1000.0
            forwards = decode.profile["prefill_forward_ms"] + decode.profile["decode_forward_ms"]
            self._last_profile = {
                "prompt_expansion_ms": 0.0,
                "generation_ms": generation_ms,
                "prefill_forward_ms": decode.profile["prefill_forward_ms"],
                "decode_forward_ms": decode.profile["decode_forward_ms"],
                "generation_overhead_ms": max(0.0, generation_ms - forwards),
                "num_prefill_forwards": int(decode.profile["num_prefill_forwards"]),
                "num_decode_forwards": int(decode.profile["num_decode_forwards"]),
                "scheduler_overhead_ms": decode.profile["scheduler_overhead_ms"],
                "cache_management_overhead_ms": decode.profile["cache_management_overhead_ms"],
                "post_processing_ms": (done - generated) * 1000.0,
                "total_ms": total_ms,
                "num_generated_tokens": tokens,
                "tokens_per_second": speed,
                "batch_size": int(request.prompt_ids.shape[0]),
                "num_samples_per_prompt": 1,
                "prompt_length": int(request.prompt_ids.shape[1]),
                "response_length": max((len(r) for r in responses), default=0),
                "active_batch_size": decode.active_batch_size,
                "continuous_batch_size": max_batch_size,
            }
        return batch

    def _continuous_batch(self, request: RolloutRequest, responses: list[list[int]]) -> RolloutBatch:
        """Each prompt as it came, its response, then padding (unattended) to the longest response."""
        pad = _pad_id(self.tokenizer)
        ids, mask = request.prompt_ids, request.prompt_attention_mask
        longest = max(len(r) for r in responses)
        tail = torch.full((ids.shape[0], longest), pad, dtype=ids.dtype, device=ids.device)
        tail_mask = torch.zeros((ids.shape[0], longest), dtype=mask.dtype, device=ids.device)
        for row, response in enumerate(responses):
            tail[row, : len(response)] = torch.tensor(response, dtype=ids.dtype, device=ids.device)
            tail_mask[row, : len(response)] = 1
        return RolloutBatch(
            input_ids=torch.cat([ids, tail], dim=1),
            attention_mask=torch.cat([mask, tail_mask], dim=1),
            response_start_idx=torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device),
        )

    def get_last_profile(self) -> dict[str, Any] | None:
        """The latest `generate`'s phase times with `enable_profiling` (DeepSpeed's keys), else None."""
        return self._last_profile

    def get_last_continuous_stats(self) -> dict[str, Any] | None:
        """The latest continuous-batching decode's cache statistics (DeepSpeed's keys), else None."""
        return self._last_continuous_stats

    def sync_weights(self, step: int) -> None:
        """Nothing to do: the rollout generates with the engine's live weights."""
        return None


__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig"]
