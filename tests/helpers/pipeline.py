"""A small layer list, its data, a single-process reference and the pipeline runner for tests/distributed/test_pipeline.

[Note: pipeline parity model]
Linear layers without biases between tanhs, an MSE loss: every parameter has a real gradient (as helpers/parity.py's
TINY model), so AdamW's early sign-like steps do not turn rounding noise into +-lr moves and fp32 losses agree with
the reference to far below 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WIDTH, DEPTH, SEED = 16, 6, 7
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
SGD_LR = 0.5


@dataclass(frozen=True)
class PipeCase:
    stages: int
    schedule: str = "1f1b"
    zero: int = 0
    gas: int = 4
    micro: int = 2
    steps: int = 4
    clip: float = 0.0
    tied: bool = False  # first and last layer one TiedLayerSpec (the last applies its transpose)
    checkpoint_every: int = 0  # activation_checkpoint_interval
    sgd: bool = False  # SGD instead of AdamW: the update follows the clipping norm (Adam's hardly does)
    serial_load: bool = False  # zero_optimization.pipeline_loading_checkpoint: the stages load in turns

    @property
    def name(self) -> str:
        extras = ("_tied" if self.tied else "") + (f"_ac{self.checkpoint_every}" if self.checkpoint_every else "")
        extras += "_sgd" if self.sgd else ""
        return f"pp{self.stages}_{self.schedule}_zero{self.zero}_gas{self.gas}_clip{self.clip}{extras}"


def layers() -> list[nn.Module]:
    torch.manual_seed(SEED)
    out: list[nn.Module] = []
    for _ in range(DEPTH):
        out += [nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh()]
    return out


def _transposed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


def tied_specs() -> list[Any]:
    """Built layer by layer from seed SEED + index (seed_layers=True); the key "tied" at both ends."""
    from zeroshard.pipe import LayerSpec, TiedLayerSpec

    specs: list[Any] = [TiedLayerSpec("tied", nn.Linear, WIDTH, WIDTH, bias=False), LayerSpec(nn.Tanh)]
    for _ in range(DEPTH - 2):
        specs += [LayerSpec(nn.Linear, WIDTH, WIDTH, bias=False), LayerSpec(nn.Tanh)]
    specs.append(TiedLayerSpec("tied", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=_transposed))
    return specs


def tied_reference_model() -> nn.Module:
    from zeroshard.pipe import TiedLayerSpec

    built: dict[str, nn.Module] = {}
    funcs: list[Any] = []
    for index, spec in enumerate(tied_specs()):
        torch.manual_seed(SEED + index)
        if isinstance(spec, TiedLayerSpec):
            first = spec.key not in built
            module = built.setdefault(spec.key, spec.build())
            funcs.append(module if first else (lambda x, m=module: _transposed(m, x)))
        else:
            funcs.append(spec.build())

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mods = nn.ModuleList([f for f in funcs if isinstance(f, nn.Module)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for f in funcs:
                x = f(x)
            return x

    return Tied()


def batches(case: PipeCase, dp: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """[step][replica][micro] -> (inputs, targets)."""
    g = torch.Generator().manual_seed(11)

    def micro() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(case.micro, WIDTH, generator=g), torch.randn(case.micro, WIDTH, generator=g)

    return [[[micro() for _ in range(case.gas)] for _ in range(dp)] for _ in range(case.steps)]


def config(case: PipeCase) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.gas,
        "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}} if case.sgd else ADAMW,
        "zero_optimization": {"stage": case.zero, "pipeline_loading_checkpoint": case.serial_load},
        "gradient_clipping": case.clip,
        "pipeline": {"stages": case.stages, "schedule": case.schedule},
    }


def reference(case: PipeCase, dp: int) -> list[float]:
    """Plain PyTorch on one process: the whole global batch per step, gradients averaged over it."""
    model = tied_reference_model() if case.tied else nn.Sequential(*layers())
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=SGD_LR) if case.sgd else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    losses = []
    for step in batches(case, dp):
        total = 0.0
        for replica in step:
            for x, y in replica:
                loss = nn.functional.mse_loss(model(x), y)
                (loss / (case.gas * dp)).backward()
                total += loss.item()
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / (case.gas * dp))
    with torch.no_grad():  # eval_batch over step 0's data with the trained model
        evals = [nn.functional.mse_loss(model(x), y).item() for replica in batches(case, dp)[0] for x, y in replica]
    return losses + [sum(evals) / len(evals)]


def replica_iter(case: PipeCase, dp: int, replica: int, steps: range) -> Any:
    data = batches(case, dp)
    return iter([mb for s in steps for mb in data[s][replica]])


def build(case: PipeCase) -> Any:
    import zeroshard
    from zeroshard.pipe import PipelineModule

    net = PipelineModule(
        layers=tied_specs() if case.tied else layers(),
        num_stages=case.stages,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
        seed_layers=case.tied,
        seed_fn=torch.manual_seed,
        base_seed=SEED,
        activation_checkpoint_interval=case.checkpoint_every,
    )
    engine, _, _, _ = zeroshard.initialize(model=net, config=config(case))
    return engine


def train(engine: Any, case: PipeCase, steps: range) -> list[float]:
    dp = engine.dp_world_size
    it = replica_iter(case, dp, engine.pipe.groups.replica, steps)
    return [float(engine.train_batch(data_iter=it)) for _ in steps]


def evaluate(engine: Any, case: PipeCase) -> float:
    it = replica_iter(case, engine.dp_world_size, engine.pipe.groups.replica, range(1))
    return float(engine.eval_batch(data_iter=it))
