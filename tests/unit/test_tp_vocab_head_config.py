"""`tensor_parallel.vocab_parallel_lm_head` and `vocab_parallel_ce_backend` read without a process group
([Note: vocabulary-parallel LM head]): what is taken, and one line for each combination refused."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from zeroshard.errors import ConfigError
from zeroshard.tp.build import local_vocab_head_of
from zeroshard.tp.vocab_head import local_logits


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({}, False),
        ({"vocab_parallel_lm_head": None}, False),
        ({"vocab_parallel_lm_head": False, "vocab_parallel_ce_backend": "torch"}, False),
        ({"vocab_parallel_lm_head": True}, True),
        ({"vocab_parallel_lm_head": True, "vocab_parallel_ce_backend": "liger"}, True),
    ],
)
def test_taken(block: dict, expected: bool) -> None:
    assert local_vocab_head_of(block) is expected


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ({"vocab_parallel_lm_head": "yes"}, "expected true, false or null"),
        ({"vocab_parallel_lm_head": True, "vocab_parallel_ce_backend": "triton"}, 'expected "torch" or "liger"'),
        ({"vocab_parallel_ce_backend": "liger"}, "needs vocab_parallel_lm_head true"),
        ({"vocab_parallel_lm_head": True, "loss_parallel": True}, "set one of them"),
    ],
)
def test_refused_in_one_line(block: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as error:
        local_vocab_head_of(block)
    assert "\n" not in str(error.value)


class _Lm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 8)


def test_a_plan_without_a_sharded_head_is_refused() -> None:
    gathered = {"lm_head": ColwiseParallel(output_layouts=Replicate()), "q": ColwiseParallel(), "o": RowwiseParallel()}
    with pytest.raises(ConfigError, match="needs one column-split nn.Linear output head .* found none"):
        local_logits(_Lm(), gathered)


def test_a_model_without_a_loss_hook_is_refused() -> None:
    from torch.distributed.tensor import Shard

    plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    with pytest.raises(ConfigError, match="_Lm has no loss_function hook"):
        local_logits(_Lm(), plan)


def test_the_head_hands_on_local_logits() -> None:
    from torch.distributed.tensor import Shard

    model = _Lm()
    model.loss_function = lambda *a, **k: None  # a Hugging Face model's writable hook
    plan = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), "q": ColwiseParallel()}
    out = local_logits(model, plan)
    assert out["lm_head"].use_local_output and out["lm_head"].output_layouts == (Shard(-1),)
    assert out["q"] is plan["q"]
