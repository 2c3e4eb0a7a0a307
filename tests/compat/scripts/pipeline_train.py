"""A small convolutional classifier trained with DeepSpeed pipeline parallelism (2 stages), on synthetic data.

Re-created (trimmed, rewritten) from DeepSpeedExamples `training/pipeline_parallelism/train.py`,
commit 45b4b7156c8794a3452a5a7d03dbd8d797068569. Kept as upstream: `add_config_arguments`,
`init_distributed(dist_backend=args.backend)`, `deepspeed.runtime.utils.set_random_seed`,
`PipelineModule(layers=, loss_fn=, num_stages=, partition_method=, activation_checkpoint_interval=)`,
`initialize(args=, model=, model_parameters=, training_data=)`, `train_batch()`; and the data-parallel path
(`-p 0`) with `RepeatingLoader` and `gradient_accumulation_steps()`. Changed: a small convnet instead of
AlexNet, synthetic 16x16 images instead of CIFAR-10, gloo instead of nccl, no `torch.cuda` calls.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
PipelineModule = importlib.import_module(f"{deepspeed.__name__}.pipe").PipelineModule
RepeatingLoader = importlib.import_module(f"{deepspeed.__name__}.utils").RepeatingLoader


def synthetic_trainset(samples: int = 64) -> torch.utils.data.Dataset:
    generator = torch.Generator().manual_seed(1234)
    images = torch.randn(samples, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def small_net() -> nn.Module:
    net = nn.Module()
    net.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    net.avgpool = nn.AdaptiveAvgPool2d((4, 4))
    net.classifier = nn.Sequential(nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
    return net


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=4, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model: nn.Module) -> list:
    return [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]


def train_base(args: argparse.Namespace) -> list:
    torch.manual_seed(args.seed)
    net = nn.Sequential(
        *[layer if isinstance(layer, nn.Module) else nn.Flatten(1) for layer in join_layers(small_net())]
    )
    engine, _, dataloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=synthetic_trainset(),
    )
    data_iter = iter(RepeatingLoader(dataloader))
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for _micro_step in range(args.steps * engine.gradient_accumulation_steps()):
        batch = next(data_iter)
        loss = criterion(engine(batch[0].to(engine.device)), batch[1].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_pipe(args: argparse.Namespace, part: str = "parameters") -> list:
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = PipelineModule(
        layers=join_layers(small_net()),
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=part,
        activation_checkpoint_interval=0,
    )
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=synthetic_trainset(),
    )
    return [engine.train_batch().item() for _step in range(args.steps)]


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    losses = train_base(args) if args.pipeline_parallel_size == 0 else train_pipe(args)
    # train_batch returns the loss on the last stage; rank 0 prints what the last stage sent it
    result = torch.tensor(losses)
    dist.broadcast(result, src=dist.get_world_size() - 1)
    if dist.get_rank() == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": result.tolist()}), flush=True)
