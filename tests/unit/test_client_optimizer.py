"""[Note: client optimizers on flat shards]: a client optimizer the zero backend's flat shards would change is refused
in one line (transformers' Adafactor ran unfactored there, clipped by a whole shard's RMS); an unknown one needs
`zero_allow_untested_optimizer: true`, as DeepSpeed asks; the fsdp2 backend takes any."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.client import check_client_optimizer
from zeroshard.optim.lion import Lion


def _cfg(stage: int = 2, allow: bool = False, backend: str = "zero") -> SimpleNamespace:
    return SimpleNamespace(
        zeroshard=SimpleNamespace(backend=backend),
        zero_optimization=SimpleNamespace(stage=stage),
        zero_allow_untested_optimizer=allow,
    )


class Elementwise(torch.optim.SGD):
    """A user's own optimizer (here elementwise, but zeroshard cannot know it)."""


class GaLoreAdamW(torch.optim.AdamW):
    """Named as the GaLore family is."""


class MuonWithAuxAdam(torch.optim.SGD):
    """Named as KellerJordan's Muon is."""


class FusedLamb(torch.optim.SGD):
    """Named as DeepSpeed's and apex's LAMB are."""


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4, 4))]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.AdamW(p),
        lambda p: torch.optim.RMSprop(p),
        lambda p: torch.optim.Adagrad(p),
        lambda p: Lion(p),
    ],
)
def test_elementwise_optimizers_are_taken(make) -> None:
    for stage in (0, 1, 2, 3):
        check_client_optimizer(make(_params()), _cfg(stage))


def test_whole_tensor_optimizers_are_refused_whatever_the_key_says() -> None:
    from transformers.optimization import Adafactor

    cases = [
        (Adafactor(_params(), lr=1e-3, relative_step=False, scale_parameter=False), "Adafactor factors"),
        (torch.optim.Adafactor(_params()), "Adafactor factors"),
        (torch.optim.LBFGS(_params()), "LBFGS needs a closure"),
        (GaLoreAdamW(_params()), "GaLore projects"),
        (MuonWithAuxAdam(_params(), lr=0.1), "Muon orthogonalises"),
        (FusedLamb(_params(), lr=0.1), "LAMB scales each parameter's update by its trust ratio"),
    ]
    for optimizer, reason in cases:
        for allow in (False, True):
            with pytest.raises(ConfigError, match=reason) as refused:
                check_client_optimizer(optimizer, _cfg(2, allow))
            assert "flat shards of many parameters" in str(refused.value)
            assert '"backend": "fsdp2"' in str(refused.value)
        check_client_optimizer(optimizer, _cfg(2, backend="fsdp2"))  # per-parameter shards: any optimizer


def test_an_unknown_optimizer_needs_zero_allow_untested_optimizer(caplog) -> None:
    with pytest.raises(ConfigError, match='set "zero_allow_untested_optimizer": true'):
        check_client_optimizer(Elementwise(_params(), lr=0.1), _cfg(1))
    logging.getLogger("zeroshard").addHandler(caplog.handler)  # zeroshard's logger does not propagate
    try:
        check_client_optimizer(Elementwise(_params(), lr=0.1), _cfg(1, allow=True))
    finally:
        logging.getLogger("zeroshard").removeHandler(caplog.handler)
    assert "optimizer Elementwise on flat shards of many parameters" in caplog.text
