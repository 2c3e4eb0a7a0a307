"""What `initialize` returns for each optimizer / LR-scheduler combination, and ZeRO without an optimizer.

Re-created (as plain functions run on 2 ranks, rewritten) from DeepSpeed `tests/unit/runtime/test_ds_initialize.py`,
commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641: `TestNoOptim` (stages 0 and 3, `zero.Init(enabled=,
config_dict_or_path=)`, `offload_param`, bf16 where the accelerator has it, forward passes only, `see_memory_usage`),
`TestClientOptimizer` and `TestClientLrScheduler` (the 3x3 grid, the invalid combination raising AssertionError).
Changed: config "Adam" gets `torch_adam: true` so that DeepSpeed does not JIT-build FusedAdam on the CPU, and the
None-optimizer case checks for torch's Adam accordingly (upstream: FusedAdam; `TestConfigOptimizer` is left out for
the same reason); every accepted combination then trains two steps, and the losses and learning rates are
reported so the two libraries can be compared. `TestOptimizerImplementation` and the bf16 unfused optimizer test
are left out (they check DeepSpeed's internal optimizer classes).
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import importlib
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim import Adam, AdamW, Optimizer
from torch.optim.lr_scheduler import LambdaLR, _LRScheduler

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
_lib = deepspeed.__name__
get_accelerator = importlib.import_module(f"{_lib}.accelerator").get_accelerator
lr_schedules = importlib.import_module(f"{_lib}.runtime.lr_schedules")
WARMUP_LR, WarmupLR = lr_schedules.WARMUP_LR, lr_schedules.WarmupLR
ADAM_OPTIMIZER = importlib.import_module(f"{_lib}.runtime.config").ADAM_OPTIMIZER
see_memory_usage = importlib.import_module(f"{_lib}.runtime.utils").see_memory_usage


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim: int, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


def random_dataloader(model, total_samples: int, hidden_dim: int, device, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    data = torch.randn(total_samples, hidden_dim, generator=generator).to(device=device, dtype=dtype)
    label = torch.randint(0, hidden_dim, (total_samples,), generator=generator).to(device)
    dataset = torch.utils.data.TensorDataset(data, label)
    return torch.utils.data.DataLoader(dataset, batch_size=model.train_micro_batch_size_per_gpu())


def check_no_optim(zero_stage: int) -> list[float]:
    ds_config = {
        "train_batch_size": dist.get_world_size(),
        "zero_optimization": {"stage": zero_stage, "offload_param": {"device": "cpu"}},
    }
    dtype = torch.float32
    if get_accelerator().is_bf16_supported():
        ds_config["bf16"] = {"enabled": True}
        dtype = torch.bfloat16
    elif get_accelerator().is_fp16_supported():
        ds_config["fp16"] = {"enabled": True}
        dtype = torch.float16
    hidden_dim = 4
    torch.manual_seed(0)
    with deepspeed.zero.Init(enabled=zero_stage == 3, config_dict_or_path=ds_config):
        model = SimpleModel(hidden_dim, nlayers=8)
    see_memory_usage("pre-init", force=True)
    model, _, _, _ = deepspeed.initialize(model=model, config=ds_config)
    see_memory_usage("post-init", force=True)
    data_loader = random_dataloader(
        model=model, total_samples=8, hidden_dim=hidden_dim, device=model.device, dtype=dtype
    )
    losses = [model(batch[0], batch[1]).item() for batch in data_loader]
    see_memory_usage("post-fwds", force=True)
    return losses


def train_two_steps(engine) -> list[float]:
    hidden_dim = 10
    out = []
    for batch in random_dataloader(model=engine, total_samples=2, hidden_dim=hidden_dim, device=engine.device):
        loss = engine(batch[0], batch[1])
        engine.backward(loss)
        engine.step()
        out += [loss.item(), engine.get_lr()[0]]
    return out


def check_client_optimizer(optimizer_type: type | None) -> list[float]:
    def _optimizer_callable(params) -> Optimizer:
        return AdamW(params=params)

    torch.manual_seed(0)
    hidden_dim = 10
    model = SimpleModel(hidden_dim)
    config_dict = {"train_batch_size": dist.get_world_size()}
    if optimizer_type is None:
        client_optimizer = None
        config_dict["optimizer"] = {"type": ADAM_OPTIMIZER, "params": {"torch_adam": True}}
    elif optimizer_type is Optimizer:
        client_optimizer = Adam(model.parameters())
    else:
        client_optimizer = _optimizer_callable

    engine, ds_optimizer, _, _ = deepspeed.initialize(
        config=config_dict, model=model, model_parameters=list(model.parameters()), optimizer=client_optimizer
    )
    if client_optimizer is None:
        assert isinstance(ds_optimizer, Adam), type(ds_optimizer)
    elif isinstance(client_optimizer, Optimizer):
        assert ds_optimizer == client_optimizer
    else:
        assert isinstance(ds_optimizer, AdamW), type(ds_optimizer)
    return train_two_steps(engine)


def check_client_lr_scheduler(scheduler_type, optimizer_type) -> list[float]:
    def _my_lambda(epoch: int) -> float:
        return epoch // 10

    def _optimizer_callable(params) -> Optimizer:
        return torch.optim.AdamW(params=params)

    def _lr_scheduler_callable(optimizer) -> _LRScheduler:
        return LambdaLR(optimizer, _my_lambda)

    torch.manual_seed(0)
    hidden_dim = 10
    model = SimpleModel(hidden_dim)
    config_dict = {"train_batch_size": dist.get_world_size()}
    client_optimizer = None
    client_scheduler = None
    if optimizer_type is None:
        config_dict["optimizer"] = {"type": ADAM_OPTIMIZER, "params": {"torch_adam": True}}
    elif optimizer_type is Optimizer:
        client_optimizer = torch.optim.Adam(model.parameters())
    else:
        client_optimizer = _optimizer_callable

    if scheduler_type is None:
        config_dict["scheduler"] = {"type": WARMUP_LR, "params": {}}
    elif scheduler_type == _LRScheduler:
        if isinstance(client_optimizer, Optimizer):
            client_scheduler = LambdaLR(client_optimizer, _my_lambda)
        else:
            # the invalid combination: a scheduler built on an optimizer the engine does not use
            client_scheduler = LambdaLR(torch.optim.Adam(model.parameters()), _my_lambda)
    else:
        client_scheduler = _lr_scheduler_callable

    kwargs = dict(
        config=config_dict,
        model=model,
        model_parameters=list(model.parameters()),
        optimizer=client_optimizer,
        lr_scheduler=client_scheduler,
    )
    if isinstance(client_scheduler, _LRScheduler) and not isinstance(client_optimizer, Optimizer):
        try:
            deepspeed.initialize(**kwargs)
        except AssertionError:
            return []
        raise AssertionError("initialize accepted an LR scheduler built on another optimizer")
    engine, _, _, ds_lr_scheduler = deepspeed.initialize(**kwargs)
    if client_scheduler is None:
        assert isinstance(ds_lr_scheduler, WarmupLR), type(ds_lr_scheduler)
    elif isinstance(client_scheduler, _LRScheduler):
        assert ds_lr_scheduler == client_scheduler
    else:
        assert isinstance(ds_lr_scheduler, LambdaLR), type(ds_lr_scheduler)
    return train_two_steps(engine)


def main() -> None:
    deepspeed.init_distributed()
    results = {}
    for stage in (0, 3):
        results[f"no_optim_stage{stage}"] = check_no_optim(stage)
    kinds: dict = {"none": None, "optimizer": Optimizer, "callable": Callable}
    for name, optimizer_type in kinds.items():
        results[f"client_optimizer_{name}"] = check_client_optimizer(optimizer_type)
    schedulers: dict = {"none": None, "scheduler": _LRScheduler, "callable": Callable}
    for scheduler_name, scheduler_type in schedulers.items():
        for optimizer_name, optimizer_type in kinds.items():
            key = f"lr_scheduler_{scheduler_name}_optimizer_{optimizer_name}"
            results[key] = check_client_lr_scheduler(scheduler_type, optimizer_type)
    if dist.get_rank() == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": results}), flush=True)


if __name__ == "__main__":
    main()
