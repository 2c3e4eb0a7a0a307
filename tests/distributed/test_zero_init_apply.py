"""`self.apply(fn)` in a constructor under `zero_init` ([Note: Module.apply under zero_init] in loading/applied.py):
the functions run again once the parameters are real, in call order, at `initialize` and in a `GatheredParameters`
block before it; `zero_optimization.override_module_apply: false` drops them (DeepSpeed's switch); a root's
`_init_weights` recorded by `apply` runs once at materialisation, not twice; the record keeps no model alive."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import nn

from helpers.harness import run_on_ranks


def _constant(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.constant_(module.weight, 0.5)
        nn.init.constant_(module.bias, 0.25)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.apply(_constant)  # a free function, as timm's and research models' initialisers


class _Net(nn.Module):
    """The outer constructor's apply runs after the inner one's: `a.lin` ends at 3 x 0.5, `b` at 3 x its default."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _Inner()
        self.b = nn.Linear(8, 8)
        self.apply(self._triple)

    def _triple(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.mul_(3)  # through .data, as older initialisers write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a.lin(x)).sum()


class _Counted(nn.Module):
    """nanoGPT's pattern: `self.apply(self._init_weights)`, the root method `initialize` calls anyway."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            type(self).calls += 1
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def _config(override: bool) -> dict[str, Any]:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "override_module_apply": override}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
    }


def _built(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    out: dict[str, Any] = {}
    for override in (True, False):
        with zeroshard.zero_init():
            model = _Net()
        engine, *_ = zeroshard.initialize(model=model, config=_config(override))
        out[override] = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
        engine.destroy()
    with zeroshard.zero_init():
        model = _Net()
    with zeroshard.GatheredParameters([model.a.lin.weight, model.b.weight]):
        out["block"] = (model.a.lin.weight.clone(), model.b.weight.clone())
    _Counted.calls = 0
    with zeroshard.zero_init():
        counted = _Counted()
    at_construction = _Counted.calls
    engine, *_ = zeroshard.initialize(model=counted, config=_config(True))
    out["calls"] = (at_construction, _Counted.calls)
    engine.destroy()
    with zeroshard.zero_init():
        dropped = _Net()
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    out["collected"] = gone() is None
    return out


def test_apply_in_a_constructor_runs_on_real_parameters():
    for out in run_on_ranks(_built, 2):
        on, off = out[True], out[False]
        assert torch.equal(on["a.lin.weight"], torch.full((8, 8), 1.5))  # 0.5, then x3: in call order
        assert torch.equal(on["a.lin.bias"], torch.full((8,), 0.25))
        assert torch.equal(on["b.weight"], 3 * off["b.weight"])  # the same draw, tripled
        assert torch.equal(on["b.bias"], off["b.bias"])
        assert off["a.lin.weight"].unique().numel() > 1  # override_module_apply false: reset_parameters' values
        block_a, block_b = out["block"]
        assert torch.equal(block_a, torch.full((8, 8), 1.5))
        assert block_b.unique().numel() > 1  # a read-only block's own draw (not necessarily initialize's)
        assert out["calls"] == (1, 2)  # once on meta at construction, once when real: not a third time
        assert out["collected"]
