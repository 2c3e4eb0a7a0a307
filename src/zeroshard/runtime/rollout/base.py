"""The rollout contract: what a trainer hands a rollout engine (`RolloutRequest`, `SamplingConfig`), what comes back
(`RolloutBatch`), and the engine's two calls (`RolloutEngine.generate`, `sync_weights`). DeepSpeed 0.19.8's
`deepspeed.runtime.rollout.base` names and fields, so a trainer written against it runs here unchanged."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class RolloutConfig:
    """Which rollout engine `build_rollout` makes. A trainer subclasses it (as a dataclass) with its own generation
    settings.

    Attributes:
        engine: the backend: "hybrid_engine" (the training engine generates with the model it trains).
        use_graph_capture: greedy decoding replays one CUDA graph per token (CUDA only).
    """

    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclass
class SamplingConfig:
    """How one `generate` call samples.

    Attributes:
        max_new_tokens: tokens generated after each prompt (every row gets that many decode steps).
        temperature: 0 (or below) is greedy decoding; above it, sampling at that temperature.
        top_p: nucleus sampling's probability mass (1.0: off).
        top_k: sampling among the k likeliest tokens (0 or below: off).
        n_samples_per_prompt: responses per prompt; the batch that comes back holds each prompt's in adjacent rows.
        continuous_batch_size: greedy decoding with at most this many rows live at once, a finished row making room
            for the next prompt (None: the whole request decodes as one batch).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: int | None = None


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


@dataclass
class RolloutRequest:
    """The prompts of one `generate` call, left-padded (the last column holds every prompt's last token).

    Attributes:
        prompt_ids: [B, T_p] token ids, padding on the left.
        prompt_attention_mask: [B, T_p], 1 on the prompts' tokens, 0 on padding.
    """

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(f"RolloutRequest: prompt_ids must be 2-D [B, T_p], got shape {_shape(self.prompt_ids)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"RolloutRequest: prompt_attention_mask shape {_shape(self.prompt_attention_mask)} does not match "
                f"prompt_ids {_shape(self.prompt_ids)}"
            )


@dataclass
class RolloutBatch:
    """What `generate` returns: each row a prompt (as it came, left-padded) followed by its response, responses
    right-padded to the longest.

    Attributes:
        input_ids: [B * n_samples_per_prompt, T_p + T_r].
        attention_mask: same shape; 1 on prompt and response tokens (a response's first EOS included), 0 on padding.
        response_start_idx: [B * n_samples_per_prompt], the column where each row's response starts.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"RolloutBatch: input_ids must be 2-D, got shape {_shape(self.input_ids)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"RolloutBatch: attention_mask shape {_shape(self.attention_mask)} does not match input_ids "
                f"{_shape(self.input_ids)}"
            )
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows,):
            raise ValueError(
                f"RolloutBatch: response_start_idx must be 1-D of length {rows}, got shape "
                f"{_shape(self.response_start_idx)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A rollout backend: generates responses for a trainer's prompts and takes the trained weights when told."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """The prompts with their responses, in one batch."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Bring the backend's weights up to the trainer's (nothing to do for a backend that reads them live)."""

    def shutdown(self) -> None:
        """Release the backend's resources (none by default)."""
        return None
