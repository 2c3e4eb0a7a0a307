"""muP's width groups ([Note: muP on flat shards] in optim/regroup.py): mup 1.0.0's grouping, order and arithmetic,
and the one-line refusals (no `infshape`, three infinite dimensions, no lr, a DeepSpeed-only key torch's class
lacks)."""

from __future__ import annotations

import pytest
import torch

from helpers.mup_shapes import InfShape
from zeroshard.errors import ConfigError
from zeroshard.optim import probe_optimizer
from zeroshard.optim.regroup import mup_groups
from zeroshard.zero.strategy import ParamGroupSpec


def _param(*dims: tuple[int | None, int]) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(*(d for _, d in dims)))
    param.infshape = InfShape(dims)
    return param


def _named() -> list[tuple[str, torch.nn.Parameter]]:
    return [
        ("embed", _param((None, 10), (8, 32))),  # vocab x width: one infinite dimension (w 4)
        ("square", _param((8, 32), (8, 32))),  # width x width: w 4, fan-in/fan-out ratio 1
        ("wide", _param((8, 64), (8, 32))),  # fan-out 8x, fan-in 4x: w 4, ratio 0.5
        ("half", _param((16, 32), (8, 32))),  # fan-out 2x: w 4, ratio 2
        ("bias", _param((8, 32))),
        ("scale", _param((None, 3))),  # finite
    ]


def _summary(groups: list[ParamGroupSpec]) -> list[tuple[float, float, list[str]]]:
    return [(g.options["lr"], g.options["weight_decay"], [n for n, _ in g.params]) for g in groups]


def test_adam_groups_matrices_by_width_and_keeps_the_rest_unscaled() -> None:
    groups = mup_groups("MuAdamW", {"lr": 0.8, "weight_decay": 0.1}, [ParamGroupSpec({"eps": 1e-6}, _named())])
    assert _summary(groups) == [(0.2, 0.4, ["square", "wide", "half"]), (0.8, 0.1, ["embed", "bias", "scale"])]
    assert all(g.options["eps"] == 1e-6 for g in groups)  # the group's own options go with each part


def test_sgd_groups_matrices_by_fan_ratio_then_vectors_by_width_then_finite() -> None:
    groups = mup_groups("MuSGD", {"lr": 0.8}, [ParamGroupSpec({"weight_decay": 0.4}, _named())])
    assert _summary(groups) == [
        (0.8, 0.4, ["square"]),
        (1.6, 0.2, ["wide"]),
        (0.4, 0.8, ["half"]),
        (3.2, 0.1, ["embed", "bias"]),
        (0.8, 0.4, ["scale"]),
    ]


def test_each_user_group_is_split_on_its_own_with_its_own_lr() -> None:
    named = _named()
    user = [ParamGroupSpec({"lr": 0.4}, named[:2]), ParamGroupSpec({}, named[2:])]
    groups = mup_groups("MuAdam", {"lr": 0.8}, user)
    assert _summary(groups) == [
        (0.1, 0.0, ["square"]),
        (0.4, 0.0, ["embed"]),
        (0.2, 0.0, ["wide", "half"]),
        (0.8, 0.0, ["bias", "scale"]),
    ]


def test_refusals_name_what_to_do() -> None:
    plain = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ConfigError, match=r"parameter w \(shape \(4, 4\)\) has no `infshape`.*mup.set_base_shapes"):
        mup_groups("MuAdamW", {"lr": 0.1}, [ParamGroupSpec({}, [("w", plain)])])
    cube = _param((2, 4), (2, 4), (2, 4))
    with pytest.raises(ConfigError, match="parameter c has 3 infinite dimensions"):
        mup_groups("MuSGD", {"lr": 0.1}, [ParamGroupSpec({}, [("c", cube)])])
    with pytest.raises(ConfigError, match="optimizer.params.lr is missing"):
        mup_groups("MuAdam", {}, [ParamGroupSpec({}, _named())])
    with pytest.raises(ConfigError, match="optimizer.params.adam_w_mode is not a parameter of AdamW"):
        probe_optimizer("MuAdamW", {"lr": 0.1, "adam_w_mode": True})  # mup passes it to torch, which refuses it


@pytest.mark.parametrize(("name", "cls"), [("MuAdam", "Adam"), ("muadamw", "AdamW"), ("MuSGD", "SGD")])
def test_the_update_is_torchs_class(name: str, cls: str) -> None:
    assert type(probe_optimizer(name, {"lr": 0.1})).__name__ == cls
