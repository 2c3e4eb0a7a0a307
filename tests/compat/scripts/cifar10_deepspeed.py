"""CIFAR-10 classifier trained through the DeepSpeed API, on synthetic images.

Re-created (trimmed, rewritten) from DeepSpeedExamples `training/cifar/cifar10_deepspeed.py`,
commit 45b4b7156c8794a3452a5a7d03dbd8d797068569. Kept as upstream: `add_config_arguments`, `init_distributed`,
`get_accelerator().set_device/device_name`, `initialize(args=, model=, model_parameters=, training_data=,
config=)` with the returned data loader, `bfloat16_enabled()/fp16_enabled()`, `backward`/`step`, `local_rank`.
Dropped: the MoE variant (`deepspeed.moe`, out of scope), torchvision download, the test pass, the fp16
loss-scale details. Changed: synthetic images; `torch_adam: true` so that DeepSpeed does not JIT-build FusedAdam.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
get_accelerator = importlib.import_module(f"{deepspeed.__name__}.accelerator").get_accelerator


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--samples", default=64, type=int, help="synthetic training images")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(samples: int) -> torch.utils.data.Dataset:
    generator = torch.Generator().manual_seed(1234)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def main(args: argparse.Namespace) -> None:
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    torch.manual_seed(0)
    trainset = synthetic_cifar(args.samples)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank

    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())

    if local_rank == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main(add_argument())
