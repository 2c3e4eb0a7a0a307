"""`deepspeed.ops.lion` (FusedLion, DeepSpeedCPULion) and `deepspeed.ops.adagrad` (DeepSpeedCPUAdagrad), and DeepSpeed's
optimizer modules at their paths (`ops.adam.cpu_adam`, `ops.adam.fused_adam`, `ops.lamb.fused_lamb`, ...): DeepSpeed's
signatures, the optimizers a config builds, `isinstance` as DeepSpeed picks the class ([Note: DeepSpeed's optimizer
classes]), and the steps against DeepSpeed's CPU kernels (`-m slow`: each is JIT-built, about 75 s)."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError
from zeroshard.ops.adagrad import DeepSpeedCPUAdagrad
from zeroshard.ops.lion import DeepSpeedCPULion, FusedLion
from zeroshard.optim.lion import Lion
from zeroshard.optim.optimizers import as_deepspeed_builds, build_optimizer

MODULES = {
    "ops.adam.cpu_adam": "DeepSpeedCPUAdam",
    "ops.adam.fused_adam": "FusedAdam",
    "ops.lamb.fused_lamb": "FusedLamb",
    "ops.lion.cpu_lion": "DeepSpeedCPULion",
    "ops.lion.fused_lion": "FusedLion",
    "ops.adagrad.cpu_adagrad": "DeepSpeedCPUAdagrad",
}


@pytest.mark.parametrize("path", sorted(MODULES))
def test_deepspeeds_module_paths_hold_the_classes(path: str) -> None:
    name = MODULES[path]
    ours = getattr(importlib.import_module(f"zeroshard.{path}"), name)
    package = importlib.import_module(f"zeroshard.{path.rsplit('.', 1)[0]}")
    assert ours is getattr(package, name)
    theirs = getattr(import_deepspeed(f"deepspeed.{path}"), name)
    mine = {k: p.default for k, p in inspect.signature(ours).parameters.items()}
    reference = {k: p.default for k, p in inspect.signature(theirs.__init__).parameters.items() if k != "self"}
    assert mine == reference


def _offloaded(device: str) -> SimpleNamespace:
    return SimpleNamespace(zero_optimization=SimpleNamespace(offload_optimizer=SimpleNamespace(device=device)))


def test_lion_classes_build_the_configs_lion() -> None:
    w = torch.zeros(3, requires_grad=True)
    fused = FusedLion([w], lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    cpu = DeepSpeedCPULion([{"params": [w], "lr": 0.5}])
    assert type(fused) is type(cpu) is Lion
    assert (
        fused.defaults
        == build_optimizer("Lion", {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1}, [{"params": [w]}]).defaults
    )
    assert isinstance(fused, FusedLion) and not isinstance(fused, DeepSpeedCPULion)
    assert isinstance(cpu, DeepSpeedCPULion) and cpu.param_groups[0]["lr"] == 0.5
    # a config's Lion is DeepSpeed's FusedLion, its CPU Lion when ZeRO offloads the optimizer
    config_lion = as_deepspeed_builds(build_optimizer("Lion", {}, [{"params": [w]}]), _offloaded("none"))
    assert isinstance(config_lion, FusedLion) and not isinstance(Lion([w]), FusedLion)
    offloaded = as_deepspeed_builds(build_optimizer("Lion", {}, [{"params": [w]}]), _offloaded("cpu"))
    assert isinstance(offloaded, DeepSpeedCPULion) and not isinstance(offloaded, FusedLion)


def test_cpu_adagrad_is_torchs_adagrad_as_the_offloaded_config_builds_it() -> None:
    w = torch.zeros(3, requires_grad=True)
    opt = DeepSpeedCPUAdagrad([w], weight_decay=0.1)
    assert type(opt) is torch.optim.Adagrad and isinstance(opt, DeepSpeedCPUAdagrad)
    assert (opt.defaults["lr"], opt.defaults["eps"], opt.defaults["weight_decay"]) == (1e-2, 1e-10, 0.1)
    with pytest.raises(ConfigError, match="amsgrad=True is not supported by Adagrad"):
        DeepSpeedCPUAdagrad([w], amsgrad=True)
    # DeepSpeed builds torch's Adagrad for a config's Adagrad, its CPU Adagrad when ZeRO offloads the optimizer
    assert not isinstance(
        as_deepspeed_builds(build_optimizer("Adagrad", {}, [{"params": [w]}]), _offloaded("none")), DeepSpeedCPUAdagrad
    )
    assert isinstance(
        as_deepspeed_builds(build_optimizer("Adagrad", {}, [{"params": [w]}]), _offloaded("cpu")), DeepSpeedCPUAdagrad
    )
    assert not isinstance(torch.optim.Adagrad([w]), DeepSpeedCPUAdagrad)


def _steps(make, steps: int = 20) -> torch.Tensor:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = make([p])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(1000, generator=g)
        opt.step()
    return p.detach().clone()


@pytest.mark.slow
def test_steps_as_deepspeeds_cpu_kernels() -> None:
    ds_adagrad = import_deepspeed("deepspeed.ops.adagrad")
    ds_lion = import_deepspeed("deepspeed.ops.lion")
    theirs = _steps(lambda ps: ds_adagrad.DeepSpeedCPUAdagrad(ps, lr=1e-2, weight_decay=0.1))
    ours = _steps(lambda ps: DeepSpeedCPUAdagrad(ps, lr=1e-2, weight_decay=0.1))
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-6  # measured 5.8e-8
    theirs = _steps(lambda ps: ds_lion.DeepSpeedCPULion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1))
    ours = _steps(lambda ps: DeepSpeedCPULion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1))
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-6  # measured 4.4e-7
