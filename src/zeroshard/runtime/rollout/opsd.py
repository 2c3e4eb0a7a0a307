"""On-policy distillation pieces (DeepSpeed 0.19.8's `deepspeed.runtime.rollout.opsd`): a rollout turned into
response-only next-token targets (`ResponseTokenBatch`), and the generalized Jensen-Shannon divergence between a
student's and a teacher's logits over those targets (`generalized_jsd_loss`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroshard.runtime.rollout.base import RolloutBatch


@dataclass(frozen=True)
class ResponseTokenBatch:
    """Next-token targets of a rollout's responses. `target_ids` and `response_mask` are one column shorter than
    `input_ids`: the logits at column i predict `target_ids[:, i]` (the token at column i + 1), and the mask is 1 where
    that token is a response token (an attended one at or after the row's `response_start_idx`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> ResponseTokenBatch:
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start_idx
        if mask.device != ids.device:
            raise ValueError(
                "ResponseTokenBatch: the rollout's input_ids and attention_mask must be on the same device"
            )
        if start.device != ids.device:
            raise ValueError(
                "ResponseTokenBatch: the rollout's input_ids and response_start_idx must be on the same device"
            )
        if start.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"ResponseTokenBatch: the rollout's response_start_idx must be integers, got {start.dtype}"
            )
        width = ids.shape[1]
        if bool(((start < 1) | (start > width)).any()):
            raise ValueError(f"ResponseTokenBatch: the rollout's response_start_idx must lie in [1, {width}]")
        # column i of the targets is column i + 1 of the rollout
        columns = torch.arange(1, width, device=ids.device)
        in_response = columns[None, :] >= start[:, None]
        return cls(
            input_ids=ids,
            attention_mask=mask,
            target_ids=ids[:, 1:],
            response_mask=mask[:, 1:].bool() & in_response,
        )

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's [B, T, V] logits at the columns that predict `target_ids` (all but the last)."""
        if logits.dim() != 3:
            raise ValueError(
                f"select_causal_logits: logits must be 3-D [batch, sequence, vocabulary], got {tuple(logits.shape)}"
            )
        if logits.shape[:2] != self.input_ids.shape:
            raise ValueError(
                f"select_causal_logits: logits {tuple(logits.shape)} do not match input_ids "
                f"{tuple(self.input_ids.shape)} in their batch and sequence dimensions"
            )
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """The mean divergence over valid tokens (`loss`), and the sum and count it divides, for averaging over ranks."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def _check(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    temperature: float,
    top_k: int | None,
    clip: float | None,
) -> None:
    if student.dim() != 3 or student.shape != teacher.shape:
        raise ValueError(
            f"generalized_jsd_loss: student_logits {tuple(student.shape)} and teacher_logits {tuple(teacher.shape)} "
            "must have matching 3-D shapes"
        )
    if mask.shape != student.shape[:2]:
        raise ValueError(
            f"generalized_jsd_loss: response_mask shape {tuple(mask.shape)} must match the logits' batch and "
            f"sequence dimensions {tuple(student.shape[:2])}"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd_loss: beta must be in [0, 1], got {beta}")
    if temperature <= 0.0:
        raise ValueError(f"generalized_jsd_loss: temperature must be positive, got {temperature}")
    if top_k is not None and not 0 < top_k <= student.shape[-1]:
        raise ValueError(
            f"generalized_jsd_loss: teacher_top_k must be positive and not exceed the vocabulary size "
            f"({student.shape[-1]}), got {top_k}"
        )
    if clip is not None and clip < 0.0:
        raise ValueError(f"generalized_jsd_loss: pointwise_clip must be non-negative, got {clip}")


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_top_k: int | None = None,
    pointwise_clip: float | None = None,
) -> JSDLossOutput:
    """Generalized JSD between student and teacher next-token distributions over the tokens `response_mask` marks.

    With M = beta * P_teacher + (1 - beta) * P_student: beta * KL(teacher || M) + (1 - beta) * KL(student || M);
    beta = 0 is KL(teacher || student) (forward KL), beta = 1 is KL(student || teacher) (reverse KL). Both logits are
    divided by `temperature`; `teacher_top_k` keeps the teacher's k likeliest entries in both distributions (each
    renormalised over them); `pointwise_clip` caps each vocabulary entry's term before the sum over the vocabulary.

    Example:
        >>> s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
        >>> out = generalized_jsd_loss(s, t, torch.ones(2, 5, dtype=torch.bool), beta=0.5)
        >>> int(out.valid_token_count)
        10
    """
    _check(student_logits, teacher_logits, response_mask, beta, temperature, teacher_top_k, pointwise_clip)
    student = student_logits / temperature
    teacher = teacher_logits / temperature
    if teacher_top_k is not None:
        keep = torch.topk(teacher, k=teacher_top_k, dim=-1).indices
        student, teacher = student.gather(-1, keep), teacher.gather(-1, keep)
    s_log = F.log_softmax(student, dim=-1)
    t_log = F.log_softmax(teacher, dim=-1)
    # both probabilities made before the terms: autograd then sums each log-probability's gradient in the order
    # DeepSpeed's graph does (the same bits)
    s_p, t_p = s_log.exp(), t_log.exp()
    if beta == 0.0:
        terms = t_p * (t_log - s_log)
    elif beta == 1.0:
        terms = s_p * (s_log - t_log)
    else:
        # log M = logaddexp(log(1 - beta) + log P_s, log(beta) + log P_t), each weight rounded in the logits' dtype
        def weight(x: float) -> torch.Tensor:
            return torch.tensor(x, dtype=student.dtype, device=student.device)

        m_log = torch.logaddexp(s_log + torch.log1p(weight(-beta)), t_log + torch.log(weight(beta)))
        terms = beta * t_p * (t_log - m_log)
        terms += (1.0 - beta) * s_p * (s_log - m_log)
    if pointwise_clip is not None:
        terms = terms.clamp(max=pointwise_clip)
    mask = response_mask.to(terms.dtype)
    loss_sum = (terms.sum(dim=-1) * mask).sum()
    count = mask.sum().to(torch.long)
    return JSDLossOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, valid_token_count=count)


__all__ = ["JSDLossOutput", "ResponseTokenBatch", "generalized_jsd_loss"]
